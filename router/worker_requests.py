"""What the router asks of a worker for one attempt of a request.

prefill_request   the prompt, to a prefill worker (a retry's with `handoff_sampling`)
handoff_request   to the decode worker: pull the prefill result's KV, continue after the
                  client's first token
local_request     to the decode worker alone: prefill and decode the whole request
resume_request    to the decode worker alone after the first token went out: prompt +
                  that token is its prompt, one token fewer to go
"""

from __future__ import annotations

import time
from dataclasses import replace

from decode_worker.api import DecodeRequest
from engine.sampling_params import SamplingParams
from kv_transfer.types import KVHandle
from prefill_worker.api import PrefillRequest
from router.validation import ValidRequest


def handoff_sampling(sampling: SamplingParams) -> SamplingParams:
    """Sampling for a retry's prefill: nothing ends the request on its first token (that
    token is dropped; the KV must be handed off)."""
    return replace(
        sampling,
        ignore_eos=True,
        stop=(),
        stop_token_ids=(),
        max_tokens=max(sampling.max_tokens, 2),
    )


def prefill_request(
    req: ValidRequest, sampling: SamplingParams, deadline: float | None
) -> PrefillRequest:
    return PrefillRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=sampling,
        cache_salt=req.cache_salt,
        arrival_time=time.time(),
        deadline=deadline,
    )


def _decode_request(
    req: ValidRequest,
    deadline: float | None,
    prompt_token_ids: tuple[int, ...] | None = None,
    sampling: SamplingParams | None = None,
    handle: KVHandle | None = None,
    first_token: tuple[int, float | None] = (-1, None),
) -> DecodeRequest:
    return DecodeRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids if prompt_token_ids is None else prompt_token_ids,
        sampling=req.sampling if sampling is None else sampling,
        cache_salt=req.cache_salt,
        handle=handle,
        first_token_id=first_token[0] if handle is not None else None,
        first_logprob=first_token[1] if handle is not None else None,
        arrival_time=time.time(),
        deadline=deadline,
    )


def handoff_request(
    req: ValidRequest,
    handle: KVHandle,
    first_token: tuple[int, float | None],
    deadline: float | None,
) -> DecodeRequest:
    """The decode of a prefilled request: pull `handle`'s KV, go on after the first token."""
    return _decode_request(req, deadline, handle=handle, first_token=first_token)


def local_request(req: ValidRequest, deadline: float | None) -> DecodeRequest:
    """The whole request on the decode worker (it prefills the prompt itself)."""
    return _decode_request(req, deadline)


def resume_request(req: ValidRequest, first_token_id: int, deadline: float | None) -> DecodeRequest:
    """The rest of a request whose first token is out, computed on the decode worker alone
    (no prefill worker left): prompt + that token is prefilled there and it samples the
    second token on, so the client sees each token once."""
    return _decode_request(
        req,
        deadline,
        prompt_token_ids=(*req.prompt_token_ids, first_token_id),
        sampling=replace(req.sampling, max_tokens=req.sampling.max_tokens - 1),
    )
