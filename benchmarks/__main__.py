"""The door to the figures: `python -m benchmarks SUITE [ARGS]` runs one suite with its own
arguments (`python -m benchmarks SUITE --help`); with no suite, or --help, it lists them."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from benchmarks.registry import BY_NAME, listing, run

USAGE = """usage: python -m benchmarks SUITE [ARGS...]

Runs one benchmark suite; `python -m benchmarks SUITE --help` shows its arguments. The
figures and the exact commands that produced them: docs/benchmarks.md.
"""


def main(argv: Sequence[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(listing())
        return 0
    name, *rest = argv
    if name not in BY_NAME:
        print(f"unknown suite {name!r}\n\n{USAGE}\n{listing()}", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
