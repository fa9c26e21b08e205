"""The lazy workload (`stream`) against the eager one (`generate`), the token ids against the
string-seeded `random.Random` draws they stand for, and shards of a workload."""

from __future__ import annotations

import hashlib
import itertools
import random
import time

import pytest

from loadtests.token_stream import BLOCK, TokenStream
from loadtests.workload import Shard, generate, load_profile, profile_names, stream

# sha256 of repr(generate(load_profile(name), rate=R, duration_s=D, seed=3)) as the workload
# was made before token ids were drawn in bulk (one `random()` call a token): the requests
# are still those, bit for bit
BEFORE = {
    ("synthetic", 50.0, 20.0): "badd4197a509d713",
    ("shared_prefix", 50.0, 20.0): "53fd3c29bfd7b70d",
    ("multi_turn", 50.0, 20.0): "06077b0e367b23c8",
    ("multi_turn_long", 9.0, 30.0): "10f1bbe69a76a20a",
    ("bursty", 50.0, 20.0): "4203017e1dcbdb08",
    ("ramp_burst", 300.0, 30.0): "756122441aebccdc",
    ("mixed", 50.0, 20.0): "d7b0c316ae461be7",
}


@pytest.mark.parametrize(("name", "rate", "duration"), sorted(BEFORE))
def test_the_workload_is_the_one_made_one_draw_a_token(
    name: str, rate: float, duration: float
) -> None:
    requests = generate(load_profile(name), rate=rate, duration_s=duration, seed=3)
    digest = hashlib.sha256(repr(requests).encode()).hexdigest()[:16]
    assert digest == BEFORE[(name, rate, duration)]


@pytest.mark.parametrize("name", profile_names())
@pytest.mark.parametrize("num_requests", [None, 37])
def test_the_lazy_workload_is_the_eager_one(name: str, num_requests: int | None) -> None:
    profile = load_profile(name)
    args = dict(rate=max(40.0, profile.rate * 3), duration_s=25.0, seed=5)
    eager = generate(profile, **args, num_requests=num_requests)  # type: ignore[arg-type]
    lazy = list(stream(profile, **args, num_requests=num_requests))  # type: ignore[arg-type]
    assert len(eager) > 30
    assert lazy == eager


def test_the_lazy_workload_is_made_as_it_is_pulled() -> None:
    started = time.process_time()
    first = list(itertools.islice(stream(load_profile("synthetic"), rate=1000.0,
                                         duration_s=1e7), 3))  # fmt: skip
    assert [p.index for p in first] == [0, 1, 2]
    assert time.process_time() - started < 2.0  # 10^10 requests made eagerly: hours


@pytest.mark.parametrize("name", ["synthetic", "shared_prefix", "multi_turn", "mixed"])
def test_a_shard_is_every_kth_request_or_conversation_of_the_whole(name: str) -> None:
    profile = load_profile(name)
    whole = generate(profile, rate=60.0, duration_s=20.0, seed=1)
    parts = []
    for i in range(3):
        part = list(stream(profile, rate=60.0, duration_s=20.0, seed=1, shard=Shard(i, 3)))
        key = [p.index if p.conversation is None else p.conversation for p in part]
        assert part and all(k % 3 == i for k in key)
        parts += part
    assert sorted(parts, key=lambda p: p.index) == whole


def test_token_ids_are_the_python_random_draws_across_blocks() -> None:
    rng = random.Random("seeded:tokens")
    ids = TokenStream("seeded:tokens", 10, 500)
    got: list[int] = []
    want: list[int] = []
    for n, skip in ((5, 0), (BLOCK - 3, 7), (2 * BLOCK + 1, 0), (300, BLOCK + 5), (1, 0)):
        got += ids.take(n)
        want += [10 + int(rng.random() * 490) for _ in range(n)]
        ids.skip(skip)
        for _ in range(skip):
            rng.random()
    assert got == want
    assert len(set(got)) > 400 and min(got) >= 10 and max(got) < 500


def test_a_shard_outside_its_count_is_refused() -> None:
    with pytest.raises(ValueError, match="shard"):
        Shard(3, 3)
