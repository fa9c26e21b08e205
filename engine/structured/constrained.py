"""The constrained requests of one engine: a matcher each, fed every token the request gets,
and the mask of a step's constrained rows (engine/structured/grammars.py says how a request
goes; the engine calls this at each point).

The grammar library is loaded with the first constrained request (importing it costs ~1.5 s
and brings triton), so an engine that never sees one never pays for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.structured.grammars import FIELD, Grammars, TokenMask, accept, fill_masks
from vocabulary.sampling import SamplingParamsError, StructuredOutput

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)


class ConstrainedRequests:
    """Matchers by request id, over grammars compiled once per constraint (thread-safe:
    `compile` runs on workers' threads, everything else on the engine thread)."""

    def __init__(self, make_grammars: Callable[[], Grammars]) -> None:
        self._make_grammars = make_grammars
        self._grammars: Grammars | None = None
        self._lock = threading.Lock()
        self._matchers: dict[str, xgr.GrammarMatcher] = {}

    @property
    def grammars(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                self._grammars = self._make_grammars()
            return self._grammars

    def compile(self, constraint: StructuredOutput | None) -> None:
        """Compile `constraint` into the cache (any thread; waits for it); SamplingParamsError
        naming structured_output when it does not compile. None: nothing to do."""
        if constraint is not None:
            self.grammars.compile(constraint)

    def compiled(self, constraint: StructuredOutput) -> bool:
        """Whether `constraint` is compiled and cached already (a cache hit needs no thread to
        wait on; never builds the grammars)."""
        with self._lock:
            grammars = self._grammars
        return grammars is not None and grammars.compiled(constraint)

    def start(
        self, request_id: str, constraint: StructuredOutput | None, token_ids: Sequence[int]
    ) -> bool:
        """Track a request from its `token_ids` so far (a migrated request's prior tokens;
        a handed-off one's, with the first token). True when those already complete the
        constraint. SamplingParamsError if the tokens break it (they were not sampled under
        it: a caller's error, never the hand-off's)."""
        if constraint is None:
            return False
        matcher = self.grammars.matcher(constraint)
        if not accept(matcher, token_ids):
            raise SamplingParamsError(FIELD, "the request's tokens so far do not match it")
        self._matchers[request_id] = matcher
        return bool(matcher.is_terminated())

    def stop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Feed a sampled token; True when the request must end here: the constraint is
        complete, or (never under the mask) it refused the token."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            log.warning("request %s: token %d breaks its constraint; ended", request_id, token_id)
            return True
        return bool(matcher.is_terminated())

    def mask(self, request_ids: Sequence[str | None]) -> TokenMask | None:
        """The mask of a step's rows (a row's request id, or None for a row whose request
        ended while the step was in flight); None when no row is constrained."""
        rows = [i for i, rid in enumerate(request_ids) if rid is not None and rid in self]
        if not rows:
            return None
        matchers = [self._matchers[request_ids[i]] for i in rows]  # type: ignore[index]
        return TokenMask(tuple(rows), fill_masks(matchers, self.grammars.vocab_size))

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()
