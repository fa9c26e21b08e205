"""Choose the next token of every sampled sequence of a step, batched on torch.

Order of processing (vLLM's): the grammar mask of constrained rows (engine/structured) →
logit bias → penalties → greedy argmax for temperature-0 rows →
temperature → top-k → top-p → min-p → draw. The draw is an exponential race, `argmax(p / q)` with
`q ~ Exp(1)`, which samples exactly from `p`; `q` comes from the row's own `torch.Generator`
when the request has a seed (so its tokens do not depend on what else is in the batch) and
from the engine's generator otherwise. Log-probabilities, when asked for, are those of the
chosen token under the model's raw distribution (log-softmax of the logits before any
processing), as vLLM v1 reports them; a row with `top_logprobs` k also gets the k most likely
tokens of that distribution (one top-k over the batch, at the most any row asked for).

The sampler only picks tokens; deciding that a request stops is `engine.core.stop_checker`'s job.

`sample` leaves its result on the logits' device and never waits for the device (its few
host values go through pinned memory, `engine.device.to_device`), so the engine can queue
the next step before reading this one (overlap scheduling). A row's newest output may then
still be on the device (`SamplingRow.pending`, an index into the previous step's sampled
ids); penalties count it like the outputs the host knows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.device import to_device
from engine.structured.grammars import TokenMask, apply_token_bitmask
from vocabulary.logprobs import TopLogprobs
from vocabulary.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One sequence to sample: its parameters, token history (for penalties) and generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    pending: int = -1
    """Row of the previous step's sampled ids (`Sampler.sample`'s `previous`) holding this
    sequence's newest output, not yet in output_token_ids; -1: none."""


SampledRow = tuple[int, float | None, TopLogprobs | None]
"""One row's sample: token id, its raw logprob, its alternatives (None where not asked)."""


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    """Chosen token's raw log-probability per row; None where the request did not ask."""
    top_logprobs: tuple[TopLogprobs | None, ...] = ()
    """Per row, its `top_logprobs` most likely tokens; None where the request did not ask
    (empty: no row asked)."""

    def rows(self) -> Iterator[SampledRow]:
        tops = self.top_logprobs or (None,) * len(self.token_ids)
        return zip(self.token_ids, self.logprobs, tops, strict=True)


@dataclass(frozen=True)
class SampledTokens:
    """One step's chosen tokens, still on the logits' device (no host sync made)."""

    token_ids: torch.Tensor
    """[rows] int64."""
    logprobs: torch.Tensor | None
    """[rows] float32 raw log-probabilities of the chosen tokens; None when no row asked."""
    wants_logprobs: tuple[bool, ...]
    top_ids: torch.Tensor | None = None
    """[rows, k] int64: each row's k most likely tokens (k: the most any row asked for),
    most likely first; None when no row asked for alternatives."""
    top_logprobs: torch.Tensor | None = None
    """[rows, k] float32: their raw log-probabilities."""
    num_top: tuple[int, ...] = ()
    """Per row, how many of the k alternatives it asked for (0: none)."""

    def device_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """What the host reads of this step: ids, logprobs, top ids, top logprobs."""
        return self.token_ids, self.logprobs, self.top_ids, self.top_logprobs

    def host_output(self, host: tuple[torch.Tensor | None, ...]) -> SamplerOutput:
        """The output from `device_tensors()` copied to the host (same order)."""
        ids_t, lps_t, top_ids_t, top_lps_t = host
        assert ids_t is not None
        ids = tuple(ids_t.tolist())
        logprobs: tuple[float | None, ...] = (None,) * len(ids)
        if lps_t is not None:
            picked = zip(lps_t.tolist(), self.wants_logprobs, strict=True)
            logprobs = tuple(v if w else None for v, w in picked)
        if top_ids_t is None or top_lps_t is None:
            return SamplerOutput(ids, logprobs)
        tops = zip(top_ids_t.tolist(), top_lps_t.tolist(), self.num_top, strict=True)
        top = tuple(TopLogprobs(tuple(t[:k]), tuple(v[:k])) if k else None for t, v, k in tops)
        return SamplerOutput(ids, logprobs, top)

    def to_host(self) -> SamplerOutput:
        """Copy to the host (waits for the device)."""
        return self.host_output(self.device_tensors())


class Sampler:
    """Stateless apart from the default generator used by unseeded requests."""

    def __init__(
        self, seed: int = 0, device: torch.device | str = "cpu", vocab_size: int = 0
    ) -> None:
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def make_generator(self, seed: int, num_draws_done: int = 0) -> torch.Generator:
        """A generator for one seeded request (on the logits' device), advanced past the
        `num_draws_done` draws another engine already made for it (a hand-off continues the
        same random stream as a colocated run would; needs `vocab_size`)."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        if num_draws_done:
            if self.vocab_size <= 0:
                raise ValueError("advancing a generator needs the sampler's vocab_size")
            scratch = torch.empty(self.vocab_size, device=self.device)
            for _ in range(num_draws_done):
                scratch.exponential_(generator=g)
        return g

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        previous: torch.Tensor | None = None,
        mask: TokenMask | None = None,
    ) -> SamplerOutput:
        """`sample`, copied to the host (waits for the device)."""
        return self.sample(logits, rows, previous, mask).to_host()

    @torch.no_grad()
    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        previous: torch.Tensor | None = None,
        mask: TokenMask | None = None,
    ) -> SampledTokens:
        """One token per row of `logits` [len(rows), vocab] (float32), left on the device.

        `previous`: the previous step's sampled ids, which rows with `pending` >= 0 index.
        `mask`: the tokens constrained rows may sample (the others pay nothing)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        wants = tuple(r.params.wants_logprobs for r in rows)
        if not rows:
            return SampledTokens(torch.empty(0, dtype=torch.long, device=logits.device), None, ())
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants) else None
        if mask is not None and mask.rows:
            logits = logits.clone()
            bitmask = to_device(mask.bitmask, torch.int32, logits.device)
            row_ids = to_device(mask.rows, torch.long, logits.device)
            apply_token_bitmask(logits, row_ids, bitmask)
        if any(r.params.logit_bias for r in rows):
            logits = apply_logit_bias(logits.clone(), rows)
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows, previous)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            params = [rows[i].params for i in random_rows]
            generators = [rows[i].generator for i in random_rows]
            if len(random_rows) == len(rows):
                chosen = self._draw(self._probs(params, logits), generators)
            else:
                idx = to_device(random_rows, torch.long, logits.device)
                probs = self._probs(params, logits.index_select(0, idx))
                chosen.index_copy_(0, idx, self._draw(probs, generators))
        if raw_logprobs is None:
            return SampledTokens(chosen, None, wants)
        logprobs = raw_logprobs.gather(1, chosen[:, None]).squeeze(1)
        num_top = tuple(r.params.top_logprobs for r in rows)
        if not any(num_top):
            return SampledTokens(chosen, logprobs, wants)
        top = raw_logprobs.topk(max(num_top), dim=-1)  # one batched top-k, sliced on the host
        return SampledTokens(chosen, logprobs, wants, top.indices, top.values, num_top)

    def _probs(self, params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
        device = logits.device
        n = len(params)
        floats = to_device(
            [p.temperature for p in params] + [p.top_p for p in params] + [p.min_p for p in params],
            torch.float32,
            device,
        )
        temperature, top_p, min_p = floats[:n], floats[n : 2 * n], floats[2 * n :]
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = to_device([p.top_k for p in params], torch.long, device)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            draws = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_(
                generator=self.generator
            )
            if len(unseeded) == len(generators):
                q = draws
            else:
                q.index_copy_(0, to_device(unseeded, torch.long, probs.device), draws)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        # exponential_ may return an exact 0; 0/0 would be NaN, which argmax picks.
        return (probs / q.clamp_(min=1e-20)).argmax(dim=-1)


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], previous: torch.Tensor | None = None
) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place.

    A row's outputs are its `output_token_ids` plus, when `pending` >= 0, the token
    `previous[pending]` (still on the device)."""
    num_rows, vocab = logits.shape
    device = logits.device
    out_rows: list[int] = []
    out_tokens: list[int] = []
    prompt_rows: list[int] = []
    prompt_tokens: list[int] = []
    pending_rows: list[int] = []
    pending_sources: list[int] = []
    for i, row in enumerate(rows):
        if not row.params.has_penalties:
            continue
        out_rows += [i] * len(row.output_token_ids)
        out_tokens += row.output_token_ids
        prompt_rows += [i] * len(row.prompt_token_ids)
        prompt_tokens += row.prompt_token_ids
        if row.pending >= 0:
            pending_rows.append(i)
            pending_sources.append(row.pending)
    if pending_rows and previous is None:
        raise ValueError("a row has a pending output but no previous sampled ids were given")
    # one host->device copy for every index (no, p, k: lengths of the three groups)
    no, p, k = len(out_rows), len(prompt_rows), len(pending_rows)
    idx = to_device(
        out_rows + out_tokens + prompt_rows + prompt_tokens + pending_rows + pending_sources,
        torch.long,
        device,
    )
    output_counts = torch.zeros((num_rows, vocab), device=device)
    if no:
        ones = torch.ones(no, device=device)
        output_counts.index_put_((idx[:no], idx[no : 2 * no]), ones, accumulate=True)
    if k:
        assert previous is not None
        base = 2 * no + 2 * p
        tokens = previous.index_select(0, idx[base + k : base + 2 * k])
        output_counts.index_put_(
            (idx[base : base + k], tokens), torch.ones(k, device=device), accumulate=True
        )
    seen = torch.zeros((num_rows, vocab), dtype=torch.bool, device=device)
    if p:
        prompt_at = (idx[2 * no : 2 * no + p], idx[2 * no + p : 2 * no + 2 * p])
        seen.index_put_(prompt_at, torch.ones(p, dtype=torch.bool, device=device))
    seen |= output_counts > 0
    values = to_device(
        [r.params.repetition_penalty for r in rows]
        + [r.params.frequency_penalty for r in rows]
        + [r.params.presence_penalty for r in rows],
        torch.float32,
        device,
    )
    rep = values[:num_rows, None]
    freq = values[num_rows : 2 * num_rows, None]
    presence = values[2 * num_rows :, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * output_counts - presence * (output_counts > 0).float()


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p sets; top_k 0 = no limit."""
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token if the mass of the tokens strictly before it is below top_p (the top
    # token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, sorted_logits)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's `logit_bias` to its logits (in place; one indexed add for the batch)."""
    where = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    row_ids = to_device([w[0] for w in where], torch.long, logits.device)
    token_ids = to_device([w[1] for w in where], torch.long, logits.device)
    biases = to_device([w[2] for w in where], torch.float32, logits.device)
    return logits.index_put_((row_ids, token_ids), biases, accumulate=True)
