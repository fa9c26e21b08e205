"""The sampler's token mask (engine/structured/grammars.py): `apply_token_bitmask` sets
exactly the logits xgrammar's own `apply_token_bitmask_inplace` sets (bit j of word w is token
32 w + j; a vocabulary that is not a multiple of 32 included), on the rows asked only; and a
masked row samples only allowed tokens, greedy or not."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from engine.core.sampler import Sampler, SamplingRow
from engine.structured.grammars import TokenMask, apply_token_bitmask
from vocabulary.sampling import SamplingParams


@pytest.mark.parametrize("vocab", [32, 500, 513])
def test_the_mask_sets_what_xgrammar_sets_on_the_rows_asked(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g)
    words = -(-vocab // 32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    rows = [1, 3]
    full = torch.full((5, words), -1, dtype=torch.int32)  # xgrammar's: a row per logits row
    full[rows] = bitmask
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full, indices=rows)
    got = logits.clone()
    apply_token_bitmask(got, torch.tensor(rows), bitmask)
    assert torch.equal(got, want)
    assert torch.equal(got[[0, 2, 4]], logits[[0, 2, 4]])  # the free rows untouched


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_masked_row_samples_only_allowed_tokens(temperature: float) -> None:
    vocab = 100
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[3, 47, 99]] = True
    bits = torch.zeros(-(-vocab // 32) * 32, dtype=torch.int64)
    bits[:vocab] = allowed.long()
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
    bitmask = words.to(torch.uint32).view(torch.int32)[None, :]  # two's complement words
    params = SamplingParams(temperature=temperature, max_tokens=4)
    sampler = Sampler(seed=0)
    for seed in range(20):
        logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed))
        logits[0, 50] = 100.0  # the free favourite, banned in row 0
        rows = [SamplingRow(params, (1,), ()), SamplingRow(params, (1,), ())]
        out = sampler(logits, rows, mask=TokenMask((0,), bitmask))
        assert out.token_ids[0] in (3, 47, 99)
