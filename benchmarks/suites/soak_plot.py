"""The soak's plot: RSS of every process over time (benchmarks/suites/soak.py's JSON).

python -m benchmarks.suites.soak_plot soak.json docs/soak.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def plot(report: dict[str, Any], out: Path) -> None:
    """One panel per process (their sizes differ by 100x), the warm-up shaded, the events
    (drains, the kill) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["samples"]
    names = sorted({n for _, row in samples for n in row})
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.7 * len(names)), sharex=True)
    for ax, name in zip(axes, names, strict=True):
        pts = [(t / 60, row[name]) for t, row in samples if name in row]
        ax.plot([t for t, _ in pts], [v for _, v in pts], lw=1)
        ax.axvspan(0, report.get("warm_s", 0) / 60, color="0.9")
        for t, _ in report.get("events", []):
            ax.axvline(t / 60, color="tab:red", lw=0.6, ls=":")
        row = report["processes"].get(name)
        slope = (f"  {row['slope_rss_mb_h']:+.1f} ± {row['slope_rss_stderr_mb_h']:.1f} MB/h"
                 if row else "")  # fmt: skip
        ax.set_title(f"{name}{slope}", fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
        ax.set_ylabel("RSS MB", fontsize=7)
    axes[-1].set_xlabel("minutes (grey: warm-up; dotted: drain/undrain, kill)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python -m benchmarks.suites.soak_plot SOAK.json OUT.png")
    plot(json.loads(Path(argv[0]).read_text()), Path(argv[1]))


if __name__ == "__main__":
    main(sys.argv[1:])
