"""A sharded simulation: a large cluster of identical workers simulated as one shard of it.

`--shards K` simulates 1/K of every role's workers serving every K-th request of the workload
in send order (of a conversational workload every K-th conversation, whole: its turns share
their prefixes, so they stay on the shard that cached them; `loadtests.workload.Shard`), and
scales the report back to the cluster: counts and rates (requests, goodput, throughput,
tokens/s) times K, attainment and every latency percentile the shard's own.

Why every K-th and not a random 1/K: the router places each request on the least loaded of
all the workers, so consecutive requests go to different ones and each 1/K of the workers
sees a stream smoother than Poisson at 1/K of the rate; a shard fed every K-th arrival is that
smoother stream (Erlang-K gaps), a random thinning would be a Poisson stream with the cluster's
full pooling lost. Neither is exact: the shard's placement balances over its own workers only.

Where it is weak (docs/benchmarks.md, "Simulator", speed at scale, gives the measured errors):
small pools (a shard of a few workers pools less than the cluster: TTFT tails grow), prefix
reuse across shards (a shared prefix is cached once a shard, not once a cluster), and bursts
(a burst reaches every shard at once, as in the cluster, but one shard's workers absorb it
alone). It assumes identical workers of each role, which a `ClusterShape` is.
"""

from __future__ import annotations

from dataclasses import replace

from loadtests.goodput import GoodputReport
from loadtests.workload import Shard
from simulator.shape import ClusterShape

ROLES = ("prefill", "decode", "colocated", "split")


def shard_shape(shape: ClusterShape, shards: int) -> ClusterShape:
    """One shard of `shape`: each role's count and the router's in-flight limit (rounded
    up) / `shards`. Refuses (ValueError naming
    `--shards`) a count that does not divide every role's workers."""
    if shards < 1:
        raise ValueError(f"--shards: must be >= 1, got {shards}")
    counts = {role: getattr(shape, role) for role in ROLES}
    if any(n % shards for n in counts.values()):
        given = ", ".join(f"{role} {n}" for role, n in counts.items() if n)
        raise ValueError(f"--shards: {shards} does not divide every role's workers ({given})")
    # the router's in-flight limit is the cluster's: a shard's router holds its share (the
    # admission queue's bound, AdmissionConfig.max_waiting_requests, stays whole: a shard
    # refuses later than the cluster under overload)
    limit = -(-shape.thresholds.max_inflight_requests // shards)
    thresholds = replace(shape.thresholds, max_inflight_requests=limit)
    return replace(
        shape, thresholds=thresholds, **{role: n // shards for role, n in counts.items()}
    )


def first_shard(shards: int) -> Shard | None:
    """The part of the workload the simulated shard serves (None: all of it)."""
    return None if shards == 1 else Shard(0, shards)


def scale_report(report: GoodputReport, shards: int) -> GoodputReport:
    """The cluster's report from one shard's: counts and per-second figures times `shards`."""
    if shards == 1:
        return report
    scaled = ("requests", "completed", "failed", "good", "goodput_rps", "throughput_rps",
              "output_tokens_per_s")  # fmt: skip
    times = {name: getattr(report, name) * shards for name in scaled}
    failures = tuple((status, n * shards) for status, n in report.failures)
    return replace(report, **times, failures=failures)


def largest_shards(shape: ClusterShape, most: int, min_workers: int) -> int:
    """The most shards, up to `most`, that divide every role's workers and leave each role
    at least `min_workers` a shard (1: the shape is simulated whole)."""
    counts = [getattr(shape, role) for role in ROLES if getattr(shape, role)]
    for k in range(max(1, most), 1, -1):
        if all(n % k == 0 and n // k >= min_workers for n in counts):
            return k
    return 1
