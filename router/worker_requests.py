"""What the router asks of a worker for one attempt of a request.

prefill_request   the prompt, to a prefill worker (a retry's with `handoff_sampling`; a
                  migrated request's prompt is followed by the tokens sent but the last)
handoff_request   to the decode worker: pull the prefill result's KV, continue after the
                  client's last token (its first; a migrated request's tokens before it are
                  the decode request's `prior`)
local_request     to the decode worker alone: prefill and decode the whole request
resume_request    to the decode worker alone after tokens went out: they are its `prior`,
                  prefilled after the prompt; it samples the next one on

Each carries the router's span of its call (`trace`, router/request_spans.py) when it is traced.
"""

from __future__ import annotations

import time
from dataclasses import replace

from router.validation import ValidRequest
from vocabulary.decode_api import DecodeRequest
from vocabulary.engine_io import NO_PRIOR, PriorOutput
from vocabulary.kv_handle import KVHandle
from vocabulary.prefill_api import PrefillRequest
from vocabulary.sampling import SamplingParams
from vocabulary.tracing import TraceContext


def handoff_sampling(sampling: SamplingParams) -> SamplingParams:
    """Sampling for a retry's prefill: nothing ends the request on its first token (that
    token is dropped; the KV must be handed off) and no prompt logprobs (the client has
    them with its first token)."""
    return replace(
        sampling,
        prompt_logprobs=None,
        ignore_eos=True,
        stop=(),
        stop_token_ids=(),
        max_tokens=max(sampling.max_tokens, 2),
    )


def prefill_request(
    req: ValidRequest,
    sampling: SamplingParams,
    deadline: float | None,
    prior: PriorOutput = NO_PRIOR,
    trace: TraceContext | None = None,
) -> PrefillRequest:
    return PrefillRequest(
        request_id=req.request_id,
        prompt_token_ids=(*req.prompt_token_ids, *prior.token_ids),
        sampling=sampling,
        cache_salt=req.cache_salt,
        lora=req.lora,
        arrival_time=time.time(),
        deadline=deadline,
        trace=trace,
    )


def _decode_request(
    req: ValidRequest,
    deadline: float | None,
    handle: KVHandle | None = None,
    first_token: tuple[int, float | None] = (-1, None),
    prior: PriorOutput = NO_PRIOR,
    trace: TraceContext | None = None,
) -> DecodeRequest:
    sampling = req.sampling
    if handle is not None or prior.token_ids:  # the prompt's logprobs went with the first token
        sampling = replace(sampling, prompt_logprobs=None)
    return DecodeRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=sampling,
        cache_salt=req.cache_salt,
        lora=req.lora,
        handle=handle,
        first_token_id=first_token[0] if handle is not None else None,
        first_logprob=first_token[1] if handle is not None else None,
        arrival_time=time.time(),
        deadline=deadline,
        prior=prior,
        trace=trace,
    )


def handoff_request(
    req: ValidRequest,
    handle: KVHandle,
    last_token: tuple[int, float | None],
    deadline: float | None,
    prior: PriorOutput = NO_PRIOR,
    trace: TraceContext | None = None,
) -> DecodeRequest:
    """The decode of a prefilled request: pull `handle`'s KV (the prompt's, then `prior`'s),
    go on after the client's last token."""
    return _decode_request(req, deadline, handle, last_token, prior, trace)


def local_request(
    req: ValidRequest, deadline: float | None, trace: TraceContext | None = None
) -> DecodeRequest:
    """The whole request on the decode worker (it prefills the prompt itself)."""
    return _decode_request(req, deadline, trace=trace)


def resume_request(
    req: ValidRequest,
    prior: PriorOutput,
    deadline: float | None,
    trace: TraceContext | None = None,
) -> DecodeRequest:
    """The rest of a request whose first tokens are out (`prior`), computed on the decode
    worker alone: prompt + prior is prefilled there and it samples the next token on, so
    the client sees each token once."""
    return _decode_request(req, deadline, prior=prior, trace=trace)
