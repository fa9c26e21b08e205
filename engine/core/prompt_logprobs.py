"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's raw log-probability
given the tokens before it, and the top-k tokens at its position, computed by the engine that
prefills the prompt, on the device, and read by the host with the step's sampled tokens.

A chunk whose request still needs them (`Request.wants_prompt_logits`) is scheduled with
`SeqChunk.all_logits`: the runner returns the logits of every one of its positions
(`ScheduledBatch.logit_rows`). The logits at position p give the logprob of prompt token p+1,
so positions 0 .. prompt_len - 2 are needed; the last prompt position's row is the sample
row, as for any request. Over chunked prefill each chunk adds its positions; a recompute after
a preemption adds only those not computed yet. Prefix-cache hits are skipped for such a
request (`Scheduler._admit`): a cached position has no logits.

The log-softmax of a chunk is [its tokens, vocab] float32 beside the logits themselves: a
long prompt with prompt logprobs costs that much memory in its prefill steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.batch import ScheduledBatch
from engine.core.request import Request
from engine.device import to_device
from vocabulary.logprobs import TopLogprobs


@dataclass(frozen=True)
class PromptSpan:
    """The prompt tokens [first, first + count) of one request whose logprobs a step has."""

    request: Request
    first: int
    count: int


@dataclass(frozen=True)
class PromptLogprobsPlan:
    """Which rows of a step's logits (`ScheduledBatch.logit_rows`) are sampled and which give
    prompt logprobs, of which target tokens: what `PromptLogprobsStep.split` computes, with
    no request in it (a pipeline's last stage computes it: engine/core/pp_sampling.py)."""

    sample_rows: tuple[int, ...]
    prompt_rows: tuple[int, ...]
    targets: tuple[int, ...]
    """The prompt token each of `prompt_rows` predicts."""
    k: int
    """Top alternatives per prompt position (the most any request asked for; 0: none)."""

    def compute(
        self, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """(the rows to sample from; the targets' raw logprobs, None without prompt rows;
        the top-k (ids, logprobs) of each prompt row, None when k is 0), on the device."""
        ns, np_ = len(self.sample_rows), len(self.prompt_rows)
        idx = to_device(
            self.sample_rows + self.prompt_rows + self.targets, torch.long, logits.device
        )
        sampled = logits.index_select(0, idx[:ns])
        if not np_:
            return sampled, None, None
        logprobs = torch.log_softmax(logits.index_select(0, idx[ns : ns + np_]).float(), dim=-1)
        chosen = logprobs.gather(1, idx[ns + np_ :, None]).squeeze(1)
        if not self.k:
            return sampled, chosen, None
        values, indices = logprobs.topk(self.k, dim=-1)
        return sampled, chosen, (indices, values)


class PromptLogprobsStep:
    """The prompt logprobs of one step's `all_logits` chunks: computed on the device, copied
    to the host without waiting (the step's event, `InflightStep`, covers the copies)."""

    def __init__(
        self,
        spans: list[PromptSpan],
        chosen: torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        self.spans = spans
        tensors: tuple[torch.Tensor, ...] = (chosen, *top) if top is not None else (chosen,)
        if chosen.device.type == "cuda":
            tensors = tuple(t.to("cpu", non_blocking=True) for t in tensors)
        self._host = tensors

    @classmethod
    def split(
        cls, logits: torch.Tensor, batch: ScheduledBatch, requests: Sequence[Request]
    ) -> tuple[torch.Tensor, PromptLogprobsStep | None]:
        """`logits` as the runner returned them for `batch` → (the rows to sample from, one per
        sampled chunk; the prompt logprobs of the `all_logits` chunks, None without any)."""
        planned = cls.plan(batch, requests)
        if planned is None:
            return logits, None
        plan, spans = planned
        sampled, chosen, top = plan.compute(logits)
        if chosen is None:
            return sampled, None
        return sampled, cls(spans, chosen, top)

    @staticmethod
    def plan(
        batch: ScheduledBatch, requests: Sequence[Request]
    ) -> tuple[PromptLogprobsPlan, list[PromptSpan]] | None:
        """What `split` computes for `batch` (None: it has no `all_logits` chunk), and the
        spans of prompt tokens whose values the plan's rows give, in order."""
        if not batch.has_all_logits:
            return None
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        targets: list[int] = []
        spans: list[PromptSpan] = []
        row = 0
        for request, chunk in zip(requests, batch.chunks, strict=True):
            n = chunk.num_tokens if chunk.all_logits else int(chunk.sample)
            if chunk.all_logits:
                start = chunk.start_pos
                count = min(start + n, request.num_prompt_tokens - 1) - start
                if count > 0:
                    prompt_rows += range(row, row + count)
                    targets += request.prompt_token_ids[start + 1 : start + 1 + count]
                    spans.append(PromptSpan(request, start + 1, count))
            if chunk.sample:
                sample_rows.append(row + n - 1)
            row += n
        k = max((s.request.sampling_params.prompt_logprobs or 0 for s in spans), default=0)
        plan = PromptLogprobsPlan(tuple(sample_rows), tuple(prompt_rows), tuple(targets), k)
        return plan, spans

    def apply(self) -> None:
        """Append the step's values to each request's `prompt_logprobs` (those it does not
        have yet). Call once the step's device work is done (`InflightStep.results`)."""
        chosen = self._host[0].tolist()
        ids = self._host[1].tolist() if len(self._host) > 1 else None
        values = self._host[2].tolist() if len(self._host) > 1 else None
        at = 0
        for span in self.spans:
            request = span.request
            k = request.sampling_params.prompt_logprobs or 0
            for i in range(span.count):
                token = span.first + i  # prompt index; entry token - 1 of the list
                if token == len(request.prompt_logprobs) + 1:
                    top = TopLogprobs(
                        tuple(ids[at + i][:k]) if ids and k else (),
                        tuple(values[at + i][:k]) if values and k else (),
                    )
                    request.prompt_logprobs.append((chosen[at + i], top))
            at += span.count
