"""SamplingParams validation: every bad value names its field."""

from __future__ import annotations

from typing import Any

import pytest

from vocabulary.sampling import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("seed", -1),
        ("seed", 2**64),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("logit_bias", {5: 100.5}),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("logit_bias", {5: float("nan")}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: "1"}),
        ("logit_bias", ((5, 1.0), (5, 2.0))),
        ("logit_bias", {t: 1.0 for t in range(1025)}),
        ("logit_bias", (5, 1.0)),
        ("logit_bias", 7),
    ],
)
def test_invalid_value_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(SamplingParamsError, match=f"^{field}: ") as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_defaults_match_the_public_api() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert (p.greedy, p.has_penalties, p.max_stop_len) == (False, False, 0)


def test_lists_are_stored_as_tuples_and_params_stay_hashable() -> None:
    p = SamplingParams(stop=["ab", "xyz"], stop_token_ids=[3])  # type: ignore[arg-type]
    assert p.stop == ("ab", "xyz") and p.stop_token_ids == (3,)
    assert p.max_stop_len == 3
    assert hash(p) == hash(SamplingParams(stop=("ab", "xyz"), stop_token_ids=(3,)))


def test_greedy_and_penalty_predicates() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_logit_bias_is_stored_sorted_as_pairs_from_a_mapping_or_pairs() -> None:
    given = SamplingParams(logit_bias={9: -100, 2: 0.5})
    assert given.logit_bias == ((2, 0.5), (9, -100.0))
    assert SamplingParams(logit_bias=[(9, -100), (2, 0.5)]) == given
    assert hash(given) == hash(SamplingParams(logit_bias=given.logit_bias))


def test_top_logprobs_imply_the_chosen_tokens_logprobs() -> None:
    assert SamplingParams(top_logprobs=20).wants_logprobs
    assert SamplingParams(logprobs=True).wants_logprobs
    assert not SamplingParams(prompt_logprobs=5).wants_logprobs
