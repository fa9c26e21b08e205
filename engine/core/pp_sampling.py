"""Sampling on a pipeline's last stage: the logits never leave it, only what was sampled does.

Rank 0 (stage 0) schedules and keeps every request's state; the last stage computes the
logits. Rank 0 sends, with each step's micro-batches (engine/core/pp_runner.py), a
`StageSampling`: one `StageRow` per sampled chunk (its parameters; its prompt and output
tokens only when penalties read them; for a seeded random row the request and how many draws
its generator has made), the structured-output mask of the step (rank 0 owns the grammar
matchers and fills the mask before sending the step: the mask travels, the matchers stay)
and, with prompt logprobs, the rows and targets of `PromptLogprobsPlan`. The last stage's TP
rank 0 (`StageSampler`) samples over the whole step's logits at once, exactly as rank 0 of a
one-stage engine would (`Sampler.sample`), and sends back two tensors: every integer (token
ids, top ids) and, when a row asked for logprobs or the step has prompt logprobs, every float
(`pack` / `unpack`: rank 0 knows their shapes from what it sent).

Why the draws match one rank's: the last stage's `Sampler` is seeded with the engine's seed
and samples the same batches in the same order, so unseeded rows draw what rank 0 of a
one-stage engine draws; a seeded row's generator is the request's seed advanced by the draws
made before this sample, one per output token the request holds (a placeholder included:
`draws_before`), so the stage may drop and remake a generator (an LRU, `max_generators`)
and still draw the same. Penalties read the pending token of a placeholder row from the last
stage's own previous sample (its rows are rank 0's previous step's, in order).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.core.prompt_logprobs import PromptLogprobsPlan
from engine.core.sampler import SampledTokens, Sampler, SamplingRow
from engine.structured.grammars import TokenMask
from vocabulary.sampling import SamplingParams


@dataclass(frozen=True)
class StageRow:
    """One sampled row as the last stage needs it (`SamplingRow` without the generator)."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...] = ()
    """Only when the row has penalties (the sampler reads them then only)."""
    output_token_ids: tuple[int, ...] = ()
    """Only when the row has penalties."""
    pending: int = -1
    """As `SamplingRow.pending`: a row of the previous step's sampled ids."""
    seeded: tuple[str, int] | None = None
    """A seeded random row: (request id, draws its generator made before this sample)."""


def draws_before(row: SamplingRow) -> int:
    """Draws a seeded row's generator has made before this sample: one per output token the
    engine holds for it (a prior's and a hand-off's first token counted as drawn elsewhere),
    the pending one of the step in flight included."""
    return len(row.output_token_ids) + (row.pending >= 0)


def stage_row(request_id: str, row: SamplingRow) -> StageRow:
    params = row.params
    seeded = None
    if params.seed is not None and not params.greedy:
        seeded = (request_id, draws_before(row))
    if not params.has_penalties:
        return StageRow(params, pending=row.pending, seeded=seeded)
    prompt, output = tuple(row.prompt_token_ids), tuple(row.output_token_ids)
    return StageRow(params, prompt, output, row.pending, seeded)


@dataclass(frozen=True)
class StageSampling:
    """What the last stage samples a step with (module docstring)."""

    rows: tuple[StageRow, ...]
    mask: TokenMask | None = None
    prompt: PromptLogprobsPlan | None = None
    """The step's prompt logprobs (its `all_logits` chunks); None: the logits are the sampled
    rows themselves."""

    @classmethod
    def of(
        cls,
        request_ids: Sequence[str],
        rows: Sequence[SamplingRow],
        mask: TokenMask | None,
        prompt: PromptLogprobsPlan | None,
    ) -> StageSampling:
        """The rows rank 0 built (`sampling_rows`), for requests `request_ids`."""
        stage_rows = tuple(stage_row(rid, r) for rid, r in zip(request_ids, rows, strict=True))
        return cls(stage_rows, mask, prompt)

    @property
    def wants_logprobs(self) -> tuple[bool, ...]:
        return tuple(r.params.wants_logprobs for r in self.rows)

    @property
    def num_top(self) -> tuple[int, ...]:
        return tuple(r.params.top_logprobs for r in self.rows)

    def sizes(self) -> tuple[int, int]:
        """(integers, floats) the last stage sends back (see `pack`)."""
        n, k = len(self.rows), max(self.num_top, default=0)
        ints = n + n * k
        floats = (n if any(self.wants_logprobs) else 0) + n * k
        if self.prompt is not None and self.prompt.prompt_rows:
            p, kp = len(self.prompt.prompt_rows), self.prompt.k
            ints, floats = ints + p * kp, floats + p + p * kp
        return ints, floats


PromptTensors = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]
"""A step's prompt logprobs: the targets' raw logprobs, and the top-k (ids, logprobs)."""


def pack(
    tokens: SampledTokens, prompt: PromptTensors | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int64: token ids, top ids, prompt top ids; float32: logprobs, top logprobs, prompt
    logprobs, prompt top logprobs, or None when there is none), each flat, in that order."""
    ints = [tokens.token_ids]
    floats = [] if tokens.logprobs is None else [tokens.logprobs]
    if tokens.top_ids is not None and tokens.top_logprobs is not None:
        ints.append(tokens.top_ids.flatten())
        floats.append(tokens.top_logprobs.flatten())
    if prompt is not None:
        chosen, top = prompt
        floats.append(chosen)
        if top is not None:
            ints.append(top[0].flatten())
            floats.append(top[1].flatten())
    flat = torch.cat([t.to(torch.int64) for t in ints])
    return flat, torch.cat([t.float() for t in floats]) if floats else None


def unpack(
    sampling: StageSampling, ints: torch.Tensor, floats: torch.Tensor | None
) -> tuple[SampledTokens, PromptTensors | None]:
    """What `pack` packed, as rank 0's sampler output and prompt logprobs (views)."""
    n, k = len(sampling.rows), max(sampling.num_top, default=0)
    wants = sampling.wants_logprobs
    ids, at_i = ints[:n], n
    logprobs, at_f = None, 0
    if any(wants):
        assert floats is not None
        logprobs, at_f = floats[:n], n
    top_ids = top_lps = None
    if k:
        assert floats is not None
        top_ids, at_i = ints[at_i : at_i + n * k].view(n, k), at_i + n * k
        top_lps, at_f = floats[at_f : at_f + n * k].view(n, k), at_f + n * k
    tokens = SampledTokens(ids, logprobs, wants, top_ids, top_lps, sampling.num_top if k else ())
    plan = sampling.prompt
    if plan is None or not plan.prompt_rows:
        return tokens, None
    assert floats is not None
    p, kp = len(plan.prompt_rows), plan.k
    chosen = floats[at_f : at_f + p]
    if not kp:
        return tokens, (chosen, None)
    top = ints[at_i : at_i + p * kp].view(p, kp), floats[at_f + p : at_f + p + p * kp].view(p, kp)
    return tokens, (chosen, top)


class StageSampler:
    """The last stage's sampler (its TP rank 0): the engine's `Sampler` over the whole step's
    logits, the seeded rows' generators (an LRU of `max_generators`) and the previous step's
    sampled ids (module docstring)."""

    def __init__(
        self, seed: int, device: torch.device, vocab_size: int, max_generators: int
    ) -> None:
        self.sampler = Sampler(seed, device, vocab_size)
        self.max_generators = max_generators
        self._generators: collections.OrderedDict[str, tuple[int, int, torch.Generator]] = (
            collections.OrderedDict()
        )  # request id -> (seed, draws made, generator)
        self._previous: torch.Tensor | None = None

    def sample(
        self, logits: torch.Tensor, sampling: StageSampling
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample a step from its logits (`ScheduledBatch.logit_rows`, every micro-batch's in
        order) and `pack` the result."""
        prompt: PromptTensors | None = None
        if sampling.prompt is not None:
            logits, chosen, top = sampling.prompt.compute(logits)
            prompt = (chosen, top) if chosen is not None else None
        rows = [
            SamplingRow(
                r.params, r.prompt_token_ids, r.output_token_ids, self._generator(r), r.pending
            )
            for r in sampling.rows
        ]
        tokens = self.sampler.sample(logits, rows, self._previous, sampling.mask)
        self._previous = tokens.token_ids
        return pack(tokens, prompt)

    def _generator(self, row: StageRow) -> torch.Generator | None:
        """The row's generator, advanced past the draws made before this sample; counted as
        drawn once more (the sampler draws from it now)."""
        if row.seeded is None:
            return None
        request_id, draws = row.seeded
        seed = row.params.seed
        assert seed is not None
        held = self._generators.pop(request_id, None)
        if held is not None and held[:2] == (seed, draws):
            generator = held[2]
        else:
            generator = self.sampler.make_generator(seed, draws)
        self._generators[request_id] = (seed, draws + 1, generator)
        while len(self._generators) > self.max_generators:
            self._generators.popitem(last=False)
        return generator
