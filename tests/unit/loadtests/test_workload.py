"""The seeded workload generator: repeatable sequences, exact lengths, and each profile's shape."""

from __future__ import annotations

import hashlib
import itertools
import os
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from loadtests.workload import (
    Arrival,
    ArrivalProcess,
    LengthDist,
    PlannedRequest,
    ProfileError,
    arrival_times,
    generate,
    load_profile,
    profile_from_dict,
    profile_names,
)

SHIPPED = [
    "balanced",
    "bursty",
    "decode_heavy",
    "mixed",
    "multi_turn",
    "multi_turn_long",
    "prefill_heavy",
    "ramp_burst",
    "shared_prefix",
    "synthetic",
]


def small_profile(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "t",
        "kind": "synthetic",
        "vocab": {"low": 5, "high": 9},
        "prompt_tokens": {"median": 20, "sigma": 0.5, "min": 4, "max": 60},
        "output_tokens": {"median": 8, "sigma": 0.5, "min": 2, "max": 30},
    }
    data.update(changes)
    return data


def digest(requests: list[PlannedRequest]) -> str:
    return hashlib.sha256(repr(requests).encode()).hexdigest()


def test_shipped_profiles_load() -> None:
    assert profile_names() == SHIPPED
    for name in SHIPPED:
        profile = load_profile(name)
        assert profile.name == name and profile.description


@pytest.mark.parametrize("name", SHIPPED)
def test_fixed_seed_gives_the_same_request_sequence_twice(name: str) -> None:
    profile = load_profile(name)
    rate = 20.0 if profile.arrival.process is ArrivalProcess.SCHEDULE else 4.0  # from 0.2x
    first = generate(profile, rate=rate, duration_s=20.0, seed=7)
    second = generate(load_profile(name), rate=rate, duration_s=20.0, seed=7)
    assert len(first) > 20
    assert first == second
    other = generate(profile, rate=rate, duration_s=20.0, seed=8)
    assert digest(other) != digest(first)


def test_sequence_does_not_depend_on_the_process() -> None:
    code = (
        "import hashlib; from loadtests.workload import generate, load_profile; "
        "r = generate(load_profile('multi_turn'), rate=3.0, duration_s=15.0, seed=1); "
        "print(hashlib.sha256(repr(r).encode()).hexdigest())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    here = digest(generate(load_profile("multi_turn"), rate=3.0, duration_s=15.0, seed=1))
    assert outputs == {here}


def test_requests_have_exact_lengths_in_the_vocab_and_ignore_eos() -> None:
    profile = profile_from_dict(small_profile())
    requests = generate(profile, rate=50.0, duration_s=10.0, seed=0)
    assert all(4 <= r.prompt_tokens <= 60 for r in requests)
    assert all(2 <= r.max_tokens <= 30 for r in requests)
    assert all(5 <= t < 9 for r in requests for t in r.token_ids)
    assert {t for r in requests for t in r.token_ids} == {5, 6, 7, 8}
    assert all(r.ignore_eos and r.temperature == 0.0 for r in requests)
    lengths = [r.prompt_tokens for r in requests]
    assert 17 <= statistics.median(lengths) <= 23  # lognormal median 20


def test_ids_and_indices_follow_send_order() -> None:
    requests = generate(load_profile("synthetic"), rate=5.0, duration_s=10.0, seed=3)
    assert [r.index for r in requests] == list(range(len(requests)))
    assert [r.request_id for r in requests[:2]] == ["synthetic-3-0", "synthetic-3-1"]
    times = [r.send_at_s for r in requests]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 10.0


def test_a_longer_run_only_appends_requests() -> None:
    profile = profile_from_dict(small_profile())
    short = generate(profile, rate=10.0, duration_s=5.0, seed=0)
    long = generate(profile, rate=10.0, duration_s=10.0, seed=0)
    assert long[: len(short)] == short and len(long) > len(short)


def test_num_requests_cuts_the_workload() -> None:
    profile = load_profile("multi_turn")
    full = generate(profile, rate=5.0, duration_s=30.0, seed=0)
    cut = generate(profile, rate=5.0, duration_s=30.0, seed=0, num_requests=10)
    assert cut == full[:10]
    assert all(r.after is None or r.after < r.index for r in cut)


def test_profile_defaults_apply_when_arguments_are_omitted() -> None:
    profile = replace(profile_from_dict(small_profile()), rate=3.0, duration_s=4.0, seed=5)
    assert generate(profile) == generate(profile, rate=3.0, duration_s=4.0, seed=5)


# -- arrival processes -------------------------------------------------------------------------


def test_poisson_arrivals_have_the_target_rate_and_exponential_gaps() -> None:
    times = arrival_times(Arrival(), 20.0, 500.0, random.Random("x"))
    assert len(times) == pytest.approx(10_000, rel=0.03)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(0.05, rel=0.03)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)


def test_gamma_arrivals_with_low_burstiness_are_burstier_at_the_same_rate() -> None:
    arrival = Arrival(process=ArrivalProcess.GAMMA, burstiness=0.25)
    times = arrival_times(arrival, 20.0, 500.0, random.Random("x"))
    assert len(times) == pytest.approx(10_000, rel=0.08)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(2.0, rel=0.1)


def test_on_off_bursts_keep_the_mean_rate_and_crowd_the_burst_windows() -> None:
    arrival = Arrival(ArrivalProcess.ON_OFF, period_s=10, burst_fraction=0.2, burst_multiplier=4)
    times = arrival_times(arrival, 10.0, 1000.0, random.Random("x"))
    assert len(times) == pytest.approx(10_000, rel=0.03)
    in_burst = sum(1 for t in times if t % 10 < 2.0)
    assert in_burst / len(times) == pytest.approx(0.8, abs=0.02)  # 20% of time, 80% of load


def test_on_off_with_a_silent_quiet_phase() -> None:
    arrival = Arrival(ArrivalProcess.ON_OFF, period_s=4, burst_fraction=0.25, burst_multiplier=4)
    times = arrival_times(arrival, 5.0, 40.0, random.Random("x"))
    assert times and all(t % 4 < 1.0 for t in times)


def test_bursty_profile_is_on_off() -> None:
    assert load_profile("bursty").arrival.process is ArrivalProcess.ON_OFF


def test_a_schedule_follows_its_piecewise_linear_rate() -> None:
    arrival = Arrival(ArrivalProcess.SCHEDULE, schedule=((0.0, 1.0), (100.0, 3.0), (200.0, 3.0)))
    assert [arrival.multiplier(t) for t in (-5.0, 0.0, 50.0, 150.0, 500.0)] == [
        1.0, 1.0, 2.0, 3.0, 3.0,
    ]  # fmt: skip
    times = arrival_times(arrival, 10.0, 200.0, random.Random("x"))
    first, second = sum(1 for t in times if t < 100.0), sum(1 for t in times if t >= 100.0)
    assert first == pytest.approx(2000, rel=0.05)  # 10/s rising to 30/s: a mean of 20/s
    assert second == pytest.approx(3000, rel=0.05)


def test_a_schedule_step_and_the_ramp_burst_profile() -> None:
    profile = load_profile("ramp_burst")
    assert profile.arrival.process is ArrivalProcess.SCHEDULE
    assert profile.arrival.multiplier(225.0) == 1.6 and profile.arrival.multiplier(30.0) == 0.2
    with pytest.raises(ProfileError, match="times ascending"):
        Arrival(ArrivalProcess.SCHEDULE, schedule=((10.0, 1.0), (5.0, 1.0)))
    with pytest.raises(ProfileError, match="some multiplier must be > 0"):
        Arrival(ArrivalProcess.SCHEDULE, schedule=((0.0, 0.0),))


# -- shared prefixes and conversations ---------------------------------------------------------


def test_shared_prefix_requests_start_with_one_of_the_prefixes() -> None:
    profile = load_profile("shared_prefix")
    assert profile.shared_prefix is not None
    size, count = profile.shared_prefix.prefix_tokens, profile.shared_prefix.num_prefixes
    requests = generate(profile, rate=10.0, duration_s=20.0, seed=0)
    prefixes = {r.token_ids[:size] for r in requests}
    assert len(prefixes) == count
    assert all(r.prompt_tokens > size for r in requests)
    suffixes = {r.token_ids[size:] for r in requests}
    assert len(suffixes) == len(requests)  # the user part is each request's own


def test_each_turn_extends_the_previous_turn() -> None:
    profile = load_profile("multi_turn")
    conv = profile.conversation
    assert conv is not None
    requests = generate(profile, rate=6.0, duration_s=60.0, seed=0)
    by_index = {r.index: r for r in requests}
    turns: dict[int, list[PlannedRequest]] = {}
    for r in requests:
        assert r.conversation is not None
        turns.setdefault(r.conversation, []).append(r)
        if r.turn == 0:
            assert r.after is None and r.think_s == 0.0
            continue
        previous = by_index[r.after] if r.after is not None else None
        assert previous is not None and previous.conversation == r.conversation
        assert previous.turn == r.turn - 1
        reply_end = previous.prompt_tokens + previous.max_tokens
        assert r.token_ids[: previous.prompt_tokens] == previous.token_ids
        assert r.prompt_tokens - reply_end >= conv.user_tokens.min  # a new user message
        assert r.send_at_s == pytest.approx(previous.send_at_s + r.think_s)
        assert r.prompt_tokens <= conv.max_prompt_tokens
    assert max(len(t) for t in turns.values()) >= 4
    assert all([x.turn for x in t] == list(range(len(t))) for t in turns.values())


def test_conversations_stop_before_the_prompt_limit() -> None:
    data = small_profile(
        kind="multi_turn",
        conversation={"turns_min": 10, "turns_max": 10, "max_prompt_tokens": 100},
    )
    requests = generate(profile_from_dict(data), rate=5.0, duration_s=30.0, seed=0)
    assert requests and all(r.prompt_tokens <= 100 for r in requests)
    assert max(r.turn for r in requests) < 9


def test_closed_sessions_start_in_their_window_and_come_back_after_the_floor() -> None:
    data = small_profile(
        kind="multi_turn",
        conversation={
            "sessions": 6, "start_window_s": 3.0, "turns_min": 50, "turns_max": 50,
            "think_time_s": 1.0, "think_time_min_s": 0.5, "max_prompt_tokens": 100_000,
        },
    )  # fmt: skip
    requests = generate(profile_from_dict(data), rate=4.0, duration_s=60.0, seed=0)
    firsts = sorted(r.send_at_s for r in requests if r.turn == 0)
    assert firsts == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]  # evenly over the start window
    assert {r.conversation for r in requests} == set(range(6))
    pauses = [r.think_s for r in requests if r.turn > 0]
    assert min(pauses) >= 0.5
    # closed: a session's mean pause is sessions / rate (so `rate` stays requests/s)
    assert statistics.mean(pauses) == pytest.approx(6 / 4.0, rel=0.15)
    assert all(r.send_at_s < 60.0 for r in requests)


def test_a_think_floor_holds_every_pause_of_open_sessions() -> None:
    profile = load_profile("multi_turn")
    assert profile.conversation is not None and profile.conversation.think_time_min_s == 0
    floored = replace(profile, conversation=replace(profile.conversation, think_time_min_s=0.5))
    plain = generate(profile, rate=3.0, duration_s=20.0, seed=1)
    held = generate(floored, rate=3.0, duration_s=20.0, seed=1)
    assert any(r.think_s < 0.5 for r in plain if r.turn > 0)
    assert all(r.think_s >= 0.5 for r in held if r.turn > 0)


def test_the_host_tier_profile_keeps_every_session_alive_at_once() -> None:
    requests = generate(load_profile("multi_turn_long"))
    sessions = {r.conversation for r in requests}
    assert len(sessions) == 24
    assert max(r.send_at_s for r in requests if r.turn == 0) < 8.0
    assert sum(r.turn > 0 for r in requests) > 4 * sum(r.turn == 0 for r in requests)


# -- profile errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kind": "chat"}, "kind"),
        ({"prompt_tokens": None}, "prompt_tokens"),
        ({"prompt_tokens": {"median": 0}}, "median > 0"),
        ({"prompt_tokens": {"median": 10, "oops": 1}}, "prompt_tokens"),
        ({"arrival": {"process": "fractal"}}, "arrival.process"),
        ({"arrival": {"process": "on_off", "burst_multiplier": 6}}, "<= 1"),
        ({"vocab": {"low": 9, "high": 9}}, "vocab"),
        ({"kind": "shared_prefix"}, "shared_prefix: required"),
        ({"kind": "multi_turn"}, "conversation: required"),
        ({"kind": "multi_turn", "conversation": {"think_time_min_s": 3.0}}, "think_time_min_s"),
        ({"kind": "multi_turn", "conversation": {"sessions": -1}}, "sessions"),
        ({"colour": "blue"}, "profile"),
    ],
)
def test_malformed_profile_is_refused_naming_the_field(changes: dict, message: str) -> None:
    data = small_profile(**changes)
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ProfileError, match=message):
        profile_from_dict(data)


def test_profile_by_path_and_unknown_names(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nprompt_tokens: {median: 5}\noutput_tokens: {median: 2}\n")
    assert load_profile(path).name == "mine"
    assert load_profile(str(path)).prompt_tokens == LengthDist(median=5)
    with pytest.raises(ProfileError, match="shipped: balanced, bursty, decode_heavy"):
        load_profile("nonesuch")
    with pytest.raises(ProfileError, match="no such file"):
        load_profile(tmp_path / "missing.yaml")


def test_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate"):
        generate(profile_from_dict(small_profile()), rate=0.0, duration_s=1.0)
