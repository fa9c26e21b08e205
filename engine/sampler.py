"""Choose the next token of every sampled sequence of a step, batched on torch.

Order of processing (vLLM's): penalties → greedy argmax for temperature-0 rows → temperature →
top-k → top-p → min-p → draw. The draw is an exponential race, `argmax(p / q)` with
`q ~ Exp(1)`, which samples exactly from `p`; `q` comes from the row's own `torch.Generator`
when the request has a seed (so its tokens do not depend on what else is in the batch) and
from the engine's generator otherwise. Log-probabilities, when asked for, are those of the
chosen token under the model's raw distribution (log-softmax of the logits before any
processing), as vLLM v1 reports them.

The sampler only picks tokens; deciding that a request stops is `engine.stop_checker`'s job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """One sequence to sample: its parameters, token history (for penalties) and generator."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    """Chosen token's raw log-probability per row; None where the request did not ask."""


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

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row of `logits` [len(rows), vocab] (float32)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if not rows:
            return SamplerOutput((), ())
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(r.params.logprobs for r in rows) else None
        )
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = self._probs([rows[i].params for i in random_rows], logits[idx])
            chosen[idx] = self._draw(probs, [rows[i].generator for i in random_rows])
        token_ids = chosen.tolist()
        logprobs: list[float | None] = [None] * len(rows)
        if raw_logprobs is not None:
            picked = raw_logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
            logprobs = [
                lp if r.params.logprobs else None for lp, r in zip(picked, rows, strict=True)
            ]
        return SamplerOutput(tuple(token_ids), tuple(logprobs))

    def _probs(self, params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = apply_top_k_top_p(
                logits,
                torch.tensor([p.top_k for p in params], device=device),
                torch.tensor([p.top_p for p in params], device=device),
            )
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            q[unseeded] = torch.empty(
                (len(unseeded), probs.shape[1]), device=probs.device
            ).exponential_(generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                q[i].exponential_(generator=g)
        # exponential_ may return an exact 0; 0/0 would be NaN, which argmax picks.
        return (probs / q.clamp_(min=1e-20)).argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place."""
    num_rows, vocab = logits.shape
    device = logits.device
    output_counts = torch.zeros((num_rows, vocab), device=device)
    seen = torch.zeros((num_rows, vocab), dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        if not row.params.has_penalties:
            continue
        out = torch.tensor(list(row.output_token_ids), dtype=torch.long, device=device)
        output_counts[i].scatter_add_(0, out, torch.ones_like(out, dtype=torch.float32))
        prompt = torch.tensor(list(row.prompt_token_ids), dtype=torch.long, device=device)
        seen[i, prompt] = True
    seen |= output_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
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
