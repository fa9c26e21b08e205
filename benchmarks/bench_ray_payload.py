"""What a request's trace context costs a Ray call, by the type it travels as.

One async actor on a local Ray; the driver awaits `actor.take.remote(req)` one call at a time,
`req` a PrefillRequest (vocabulary/prefill_api.py: 64 prompt tokens, sampling, deadline) whose
`trace` is, variant by variant in rotating order within each round:

- `none`: no context (an untraced request);
- `tuple`: the (traceparent, tracestate) pair of strings it travels as
  (vocabulary/tracing.py `TraceContext`);
- `dataclass`: the same two strings in a frozen dataclass (what it was before);
- `namedtuple`: the same in a NamedTuple.

Round trip per call in µs, p50 over the rounds, and each variant's paired p50 against `none`
(the same round). Run it alone on the machine: it measures microseconds.

    python benchmarks/bench_ray_payload.py [--rounds 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from payload_types import DataclassContext, NamedContext  # noqa: E402

from vocabulary.numeric import percentile  # noqa: E402

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def requests() -> dict[str, Any]:
    from vocabulary.prefill_api import PrefillRequest
    from vocabulary.sampling import SamplingParams

    contexts: dict[str, Any] = {
        "none": None,
        "tuple": (TRACEPARENT, ""),
        "dataclass": DataclassContext(TRACEPARENT),
        "namedtuple": NamedContext(TRACEPARENT),
    }
    now = time.time()
    prompt, sampling = tuple(range(64)), SamplingParams(max_tokens=4)
    return {
        name: PrefillRequest(
            "client-7@0a1b2c3d.12",
            prompt,
            sampling,
            arrival_time=now,
            deadline=now + 3600,
            trace=context,
        )
        for name, context in contexts.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5000)
    ap.add_argument("--warmup", type=int, default=300)
    args = ap.parse_args()

    from deploy.control.launch import loopback_env

    loopback_env()
    # the actor's process imports payload_types too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    )
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Taker:
        async def take(self, req: Any) -> bool:
            return req.trace is not None

    taker = Taker.remote()  # type: ignore[attr-defined]
    reqs = requests()
    names = list(reqs)

    async def run() -> dict[str, list[float]]:
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.warmup + args.rounds):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                traced = await taker.take.remote(reqs[name])
                elapsed = (time.perf_counter() - t0) * 1e6
                assert traced == (name != "none")
                if r >= args.warmup:
                    times[name].append(elapsed)
        return times

    times = asyncio.run(run())
    ray.shutdown()
    print(f"\n{os.cpu_count()} CPUs, {args.rounds} rounds; one Ray actor call round trip, µs")
    print("| trace as | p50 | p90 | paired p50 vs none |")
    print("|---|---:|---:|---:|")
    for name in names:
        paired = [a - b for a, b in zip(times[name], times["none"], strict=True)]
        print(f"| {name} | {percentile(times[name], 50):.1f} | {percentile(times[name], 90):.1f} "
              f"| {percentile(paired, 50):+.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
