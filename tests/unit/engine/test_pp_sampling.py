"""Sampling on a pipeline's last stage (engine/core/pp_sampling.py), without processes: what rank
0 sends (rows without generators, token lists only for penalties, a seeded row's draws so
far), what comes back (`pack` / `unpack` round trip, of the sizes rank 0 expects), and the
stage's sampler drawing exactly what rank 0's `Sampler` draws with the request's generator,
whether it kept that generator or remade it."""

from __future__ import annotations

import torch

from engine.core.pp_sampling import (
    StageSampler,
    StageSampling,
    draws_before,
    pack,
    stage_row,
    unpack,
)
from engine.core.prompt_logprobs import PromptLogprobsPlan
from engine.core.sampler import Sampler, SamplingRow
from vocabulary.sampling import SamplingParams

VOCAB = 64
SEEDED = SamplingParams(temperature=1.0, seed=7, logprobs=True, top_logprobs=2)
PENALIZED = SamplingParams(temperature=0.0, repetition_penalty=1.5)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, VOCAB), generator=torch.Generator().manual_seed(seed))


def test_rows_carry_token_lists_only_for_penalties_and_a_seeded_rows_draws() -> None:
    plain = SamplingRow(SEEDED, (1, 2, 3), [4, 5], None, pending=0)
    assert draws_before(plain) == 3  # two outputs held, one pending
    row = stage_row("a", plain)
    assert (row.prompt_token_ids, row.output_token_ids, row.seeded) == ((), (), ("a", 3))
    penalized = stage_row("b", SamplingRow(PENALIZED, (1, 2), [3], None))
    assert (penalized.prompt_token_ids, penalized.output_token_ids) == ((1, 2), (3,))
    assert penalized.seeded is None  # greedy draws nothing
    sampling = StageSampling.of(["a", "b"], [plain, SamplingRow(PENALIZED, (1,), [])], None, None)
    assert sampling.wants_logprobs == (True, False) and sampling.num_top == (2, 0)


def test_pack_and_unpack_round_trip_at_the_sizes_rank_0_expects() -> None:
    rows = [SamplingRow(SEEDED, (), []), SamplingRow(PENALIZED, (), [])]
    plan = PromptLogprobsPlan(sample_rows=(2, 3), prompt_rows=(0, 1), targets=(5, 6), k=3)
    sampling = StageSampling.of(["a", "b"], rows, None, plan)
    sampled, chosen, top = plan.compute(logits(4))
    assert chosen is not None and top is not None
    tokens = Sampler(0, "cpu", VOCAB).sample(sampled, rows)
    ints, floats = pack(tokens, (chosen, top))
    assert floats is not None and (ints.numel(), floats.numel()) == sampling.sizes()
    got, prompt = unpack(sampling, ints, floats)
    assert torch.equal(got.token_ids, tokens.token_ids)
    assert got.logprobs is not None and tokens.logprobs is not None
    assert torch.equal(got.logprobs, tokens.logprobs)
    assert torch.equal(got.top_ids, tokens.top_ids) and got.num_top == (2, 0)  # type: ignore[arg-type]
    assert prompt is not None and prompt[1] is not None
    assert torch.equal(prompt[0], chosen) and torch.equal(prompt[1][0], top[0])
    assert got.to_host() == tokens.to_host()
    # greedy rows without logprobs: only the token ids come back
    greedy = StageSampling.of(["c"], [SamplingRow(PENALIZED, (), [])], None, None)
    assert greedy.sizes() == (1, 0)


def test_the_stage_draws_what_rank_0_would_whether_it_kept_the_generator_or_not() -> None:
    rank0 = Sampler(3, "cpu", VOCAB)
    generator = rank0.make_generator(7)
    want = []
    for step in range(4):  # one seeded request, one token a step
        row = SamplingRow(SEEDED, (), [0] * step, generator)
        want.append(int(rank0.sample(logits(1, step), [row]).token_ids[0]))
    stage = StageSampler(3, torch.device("cpu"), VOCAB, max_generators=1)
    got = []
    for step in range(4):
        if step == 2:  # another seeded request takes the only place: the first's is remade
            other = StageSampling.of(["b"], [SamplingRow(SEEDED, (), [])], None, None)
            stage.sample(logits(1, 99), other)
        sampling = StageSampling.of(["a"], [SamplingRow(SEEDED, (), [0] * step)], None, None)
        ints, _ = stage.sample(logits(1, step), sampling)
        got.append(int(ints[0]))
    assert got == want
