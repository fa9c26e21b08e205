"""Sampler: greedy, filters, penalties, seeds and log-probs on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p
from vocabulary.sampling import SamplingParams


def row(
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), prompt, output, generator)  # type: ignore[arg-type]


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_picks_the_argmax_per_row() -> None:
    out = Sampler()(logits_of([0.0, 3.0, 1.0], [5.0, 0.0, 1.0]), [row(temperature=0.0)] * 2)
    assert out.token_ids == (1, 0)
    assert out.logprobs == (None, None)


def test_logprobs_are_raw_log_softmax_of_the_chosen_token() -> None:
    logits = logits_of([0.0, 3.0, 1.0])
    out = Sampler()(logits, [row(temperature=0.0, logprobs=True, repetition_penalty=2.0)])
    expected = torch.log_softmax(logits, dim=-1)[0, 1].item()
    assert out.token_ids == (1,)
    assert out.logprobs[0] is not None and math.isclose(out.logprobs[0], expected, rel_tol=1e-6)


def test_top_k_one_is_greedy_even_at_high_temperature() -> None:
    sampler = Sampler(seed=1)
    logits = logits_of([0.0, 0.5, 0.4, 0.1])
    for _ in range(20):
        assert sampler(logits, [row(temperature=5.0, top_k=1)]).token_ids == (1,)


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    # probs ~ [0.6, 0.3, 0.1]: top_p=0.7 keeps tokens 0 and 1 only.
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isinf(masked[0, 2]) and not torch.isinf(masked[0, :2]).any()
    masked = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.5]))
    assert torch.isinf(masked[0, 1:]).all() and not torch.isinf(masked[0, 0])


def test_min_p_drops_unlikely_tokens() -> None:
    sampler = Sampler(seed=3)
    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05]]))
    seen = {sampler(logits, [row(min_p=0.2)]).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_seeded_rows_reproduce_regardless_of_batch_neighbours() -> None:
    logits = torch.zeros((3, 50))
    a = Sampler(seed=0)(logits, [row(generator=Sampler().make_generator(7))] * 1 + [row()] * 2)
    b = Sampler(seed=99)(logits, [row(), row(), row(generator=Sampler().make_generator(7))])
    assert a.token_ids[0] == b.token_ids[2]


def test_seeded_sequence_is_reproducible_and_seeds_differ() -> None:
    def draw(seed: int) -> list[int]:
        sampler = Sampler()
        g = sampler.make_generator(seed)
        return [sampler(torch.zeros((1, 1000)), [row(generator=g)]).token_ids[0] for _ in range(5)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_sampling_follows_the_distribution() -> None:
    sampler = Sampler(seed=0)
    logits = torch.log(torch.tensor([[0.75, 0.25]])).repeat(4000, 1)
    out = sampler(logits, [row()] * 4000)
    share = sum(out.token_ids) / 4000
    assert 0.22 < share < 0.28


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = logits_of([2.0, -2.0, 2.0, 1.0])
    out = apply_penalties(logits.clone(), [row(prompt=(0,), output=(1,), repetition_penalty=2.0)])
    assert out.tolist() == [[1.0, -4.0, 2.0, 1.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros((1, 4))
    params = {"presence_penalty": 0.5, "frequency_penalty": 0.25}
    out = apply_penalties(logits.clone(), [row(prompt=(3,), output=(1, 1, 2), **params)])
    assert out.tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_penalties_change_only_the_rows_that_ask() -> None:
    logits = logits_of([2.0, 1.0], [2.0, 1.0])
    out = Sampler()(
        logits,
        [
            row(temperature=0.0, output=(0,), repetition_penalty=4.0),
            row(temperature=0.0, output=(0,)),
        ],
    )
    assert out.token_ids == (1, 0)


def test_empty_batch() -> None:
    out = Sampler()(torch.zeros((0, 8)), [])
    assert (out.token_ids, out.logprobs) == ((), ())


def test_a_pending_output_counts_for_penalties_like_a_known_one() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5]])
    params = {"repetition_penalty": 2.0, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    known = apply_penalties(logits.clone(), [row(prompt=(0,), output=(2, 3), **params)])
    previous = torch.tensor([4, 3])  # the previous step sampled 3 for this sequence (row 1)
    pending = SamplingRow(SamplingParams(**params), (0,), (2,), None, pending=1)  # type: ignore[arg-type]
    assert torch.equal(apply_penalties(logits.clone(), [pending], previous), known)
    with pytest.raises(ValueError, match="no previous sampled ids"):
        apply_penalties(logits.clone(), [pending])


def test_sample_leaves_tokens_on_the_device_and_matches_the_host_result() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]]))
    rows = [
        row(temperature=0.0, logprobs=True),
        row(generator=Sampler().make_generator(3), top_k=2),
        row(temperature=0.0),
    ]
    out = Sampler(seed=4).sample(logits, rows)
    assert out.token_ids.dtype == torch.long and out.token_ids.shape == (3,)
    assert out.logprobs is not None and out.wants_logprobs == (True, False, False)
    rows[1] = row(generator=Sampler().make_generator(3), top_k=2)  # the same draw again
    host = Sampler(seed=4)(logits, rows)
    assert out.to_host() == host
    assert host.token_ids[0] == 0 and host.token_ids[2] == 0
    assert host.logprobs[1:] == (None, None)


def test_logit_bias_moves_only_its_own_rows_tokens_and_not_the_raw_logprobs() -> None:
    logits = logits_of([0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [5.0, 0.0, 1.0])
    rows = [
        row(temperature=0.0, logit_bias={2: 2.5}, logprobs=True),  # 1 + 2.5 > 3
        row(temperature=0.0),  # its neighbour's bias does not reach it
        row(temperature=0.0, logit_bias={0: -100.0, 2: 0.5}),  # bans the argmax
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids == (2, 1, 2)
    raw = torch.log_softmax(logits[0], dim=-1)[2].item()  # raw, as vLLM reports them
    assert out.logprobs[0] is not None and math.isclose(out.logprobs[0], raw, rel_tol=1e-6)
    # a sampled row: +100 makes the token certain, -100 all but impossible
    g = torch.Generator().manual_seed(0)
    forced = [row(temperature=1.0, logit_bias={0: 100.0}, generator=g)] * 8
    assert set(Sampler()(logits_of(*[[0.0, 9.0, 9.0]] * 8), forced).token_ids) == {0}


def test_top_logprobs_are_the_raw_top_k_of_each_row_that_asks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    rows = [
        row(temperature=0.0, top_logprobs=3),
        row(temperature=0.0),  # asks for nothing
        row(generator=Sampler().make_generator(1), top_logprobs=20, repetition_penalty=1.5),
        row(temperature=0.0, logprobs=True),  # the chosen token only
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.top_logprobs[1] is None and out.top_logprobs[3] is None
    assert out.logprobs[1] is None and out.logprobs[3] is not None
    for i, k in ((0, 3), (2, 20)):
        top, want = out.top_logprobs[i], raw[i].topk(k)
        assert top is not None and list(top.token_ids) == want.indices.tolist()
        assert list(top.logprobs) == pytest.approx(want.values.tolist(), abs=1e-6)
        chosen = out.token_ids[i]  # top_logprobs implies the chosen token's logprob
        assert out.logprobs[i] == pytest.approx(raw[i, chosen].item(), abs=1e-6)
    assert out.top_logprobs[0].token_ids[0] == out.token_ids[0]  # greedy: the top token


def test_no_top_logprobs_asked_computes_no_top_k() -> None:
    tokens = Sampler().sample(logits_of([0.0, 1.0]), [row(temperature=0.0, logprobs=True)])
    assert tokens.top_ids is None and tokens.to_host().top_logprobs == ()
