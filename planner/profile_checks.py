"""Points of a measured profile that cannot be the step they name (planner/perf_profile.py).

A step of fewer sequences (or prompt tokens) reads the same weights and less KV than a larger
one, so it is not slower by much: where a point is more than `factor` times a larger batch's
at the same context (or a longer context's at the same batch, or a longer prompt's), the
engine was in another state while it was timed, and the simulator would read that state as
the step. The H100 profile of 2026-12-07 had three (docs/benchmarks.md, "Slow engine steps"):
decode 1 x 1024 at 81 ms beside 8 x 1024 at 7.9 ms. `pdserve profile` warns with what it
finds after writing the file; `pdserve simulate`, `pdserve plan` and the agreement tool warn
when they load such a profile.
"""

from __future__ import annotations

from planner.perf_profile import PerfProfile

SUSPECT_FACTOR = 1.5
"""How much slower than a larger step a point may be before it is suspect (CPU timings on a
shared machine swing by tens of per cent; the anomalies seen were 5-10x)."""


def suspect_points(profile: PerfProfile, factor: float = SUSPECT_FACTOR) -> list[str]:
    """One line per point slower than `factor` times a larger step's time, naming both."""
    found = []
    decode = {(p.batch_size, p.context_tokens): p.step_s for p in profile.decode}
    for (b, c), s in sorted(decode.items()):
        for (b2, c2), s2 in sorted(decode.items()):
            larger = (c2 == c and b2 > b) or (b2 == b and c2 > c)
            if larger and s > factor * s2:
                found.append(
                    f"decode {b} x {c}: {s * 1e3:.2f} ms, over {factor}x the larger "
                    f"{b2} x {c2} ({s2 * 1e3:.2f} ms)"
                )
                break
    cold = sorted((p.batch_tokens, p.step_s) for p in profile.prefill if p.cached_tokens == 0)
    for i, (n, s) in enumerate(cold):
        bigger = next(((n2, s2) for n2, s2 in cold[i + 1 :] if s > factor * s2), None)
        if bigger is not None:
            found.append(
                f"prefill {n} tokens: {s * 1e3:.2f} ms, over {factor}x the larger "
                f"{bigger[0]} tokens ({bigger[1] * 1e3:.2f} ms)"
            )
    return found
