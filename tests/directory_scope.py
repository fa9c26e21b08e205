"""Session fixtures bound to the directory that defines them: a cluster that a directory's
tests share stops once the last of them has run, instead of at the end of the session, so the
clusters of directories that ran before do not idle beside the next ones (the root conftest's
`pytest_runtest_teardown` calls `stop_finished_directories`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_BOUND: list[tuple[str, Callable[[], None]]] = []


def stop_with_directory(request: pytest.FixtureRequest, stop: Callable[[], None]) -> None:
    """Call `stop` after the last test under the directory of `request`'s fixture (its
    conftest's). The fixture's own teardown still runs later: `stop` must be idempotent."""
    _BOUND.append((request._fixturedef.baseid, stop))  # type: ignore[attr-defined]


def stop_finished_directories(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop what is bound to a directory that `item` ends (the next test is elsewhere)."""

    def inside(nodeid: str, base: str) -> bool:
        return nodeid.startswith(base + "/")

    for base, stop in list(_BOUND):
        if inside(item.nodeid, base) and (nextitem is None or not inside(nextitem.nodeid, base)):
            _BOUND.remove((base, stop))
            stop()
