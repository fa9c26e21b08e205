"""Session fixtures bound to the tests that use them: a cluster that a directory's tests
share stops once the last of them has run, and a set of workers that a few modules share
stops after the last test that uses it, instead of at the end of the session, so what ran
before does not idle beside the next ones (the root conftest's `pytest_runtest_teardown`
calls `stop_finished_directories`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

_BOUND: list[tuple[str, Callable[[], None]]] = []
_BY_FIXTURE: list[tuple[str, Callable[[], None]]] = []


def stop_with_directory(request: pytest.FixtureRequest, stop: Callable[[], None]) -> None:
    """Call `stop` after the last test under the directory of `request`'s fixture (its
    conftest's). The fixture's own teardown still runs later: `stop` must be idempotent."""
    _BOUND.append((request._fixturedef.baseid, stop))  # type: ignore[attr-defined]


def stop_after_last_user(request: pytest.FixtureRequest, stop: Callable[[], None]) -> None:
    """Call `stop` after the last test of the session (in collection order, which
    `scripts/test.sh`'s xdist units keep) that uses `request`'s fixture. Its users must all
    be in one xdist unit (the fixture's directory is one). The fixture's own teardown still
    runs later: `stop` must be idempotent."""
    _BY_FIXTURE.append((request.fixturename, stop))


def _is_last_user(item: pytest.Item, fixture: str) -> bool:
    users = [i for i in item.session.items if fixture in getattr(i, "fixturenames", ())]
    return not users or users[-1] is item


def stop_finished_directories(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop what is bound to a directory that `item` ends (the next test is elsewhere), or
    to a fixture whose last user `item` is."""

    def inside(nodeid: str, base: str) -> bool:
        return nodeid.startswith(base + "/")

    for base, stop in list(_BOUND):
        if inside(item.nodeid, base) and (nextitem is None or not inside(nextitem.nodeid, base)):
            _BOUND.remove((base, stop))
            stop()
    for fixture, stop in list(_BY_FIXTURE):
        if fixture in getattr(item, "fixturenames", ()) and _is_last_user(item, fixture):
            _BY_FIXTURE.remove((fixture, stop))
            stop()
