"""TEST-ONLY: the near-tie rule for seeded sampling after a migration.

A seeded request draws token t as the argmax over the vocabulary of

    key(v) = logit'(v) / temperature - log q_t(v)

(logit' the logits after penalties, q_t the t-th draw of exponentials from the request's own
generator; engine/core/sampler.py: probs / q, whose normalization and top-k/top-p/min-p cut or a
grammar's mask change no candidate's order against another candidate). A migrated request's KV
for the tokens it had is recomputed by a prefill instead of the decode steps that first made it,
so its logits move by float rounding (~1e-6 here): its tokens must equal the undisturbed run's up
to their first difference, and there the two tokens' keys, computed from transformers' float32
logits on the common history, must differ by less than `TIE` (a near tie that rounding may flip);
what follows a flip is another history and is not compared. A lost draw, a penalty on the wrong
tokens or a generator advanced wrongly moves keys by O(1) and fails."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from references import LogitsReference

from engine.core.sampler import Sampler, SamplingRow, apply_penalties
from vocabulary.sampling import SamplingParams

TIE = 1e-3
"""Largest gap between two tokens' keys that float rounding of the logits may flip."""


def draw_keys(
    logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], outputs: Sequence[int]
) -> torch.Tensor:
    """key(v) for every token v of the draw after `outputs` (module docstring, up to a
    constant; -inf where the top-k/top-p/min-p cut leaves no probability); `logits`: the raw
    float32 logits [vocab] of that position."""
    assert params.seed is not None and not params.greedy, "a seeded, sampled request"
    row = logits[None].clone()
    if params.has_penalties:
        row = apply_penalties(row, [SamplingRow(params, list(prompt), list(outputs))])
    vocab = row.shape[1]
    sampler = Sampler(vocab_size=vocab)
    probs = sampler._probs([params], row)[0]  # temperature, top-k/top-p, softmax, min-p
    q = torch.empty(vocab).exponential_(generator=sampler.make_generator(params.seed, len(outputs)))
    return torch.log(probs) - torch.log(q.clamp(min=1e-20))


def assert_same_or_near_tie(
    got: Sequence[int],
    want: Sequence[int],
    prompt: Sequence[int],
    params: SamplingParams,
    hf_logits: LogitsReference,
) -> None:
    """`got` equals `want`, or they part at a near tie (module docstring)."""
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if first is None:
        assert len(got) == len(want), (len(got), len(want))
        return
    history = list(want[:first])
    logits = hf_logits([*prompt, *history])[-1]
    keys = draw_keys(logits, params, prompt, history)
    a, b = got[first], want[first]
    best = keys.topk(2).indices.tolist()
    gap = abs(float(keys[a] - keys[b]))
    # (a grammar's mask, not applied here, may rule out tokens keyed above both)
    ranked = set(best) == {a, b} or params.structured is not None
    assert ranked and gap < TIE, (
        f"token {first}: {a} where the undisturbed run drew {b}, keys {float(keys[a]):.6f} "
        f"vs {float(keys[b]):.6f} (gap {gap:.2e}, a near tie is < {TIE:g}); the reference's "
        f"two best: {best}"
    )
