"""The host-side state an engine keeps per unfinished request, beside the scheduler's: its
stop checker (detokenized text, stop rules: engine/core/stop_checker.py), its seeded sampling
generator, and its grammar matcher (engine/structured). `start` when a request enters the
engine (added, or arrived by hand-off), `stop` when it finishes or is aborted: everything a
request holds here goes with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.request import Request
from engine.core.sampler import Sampler
from engine.core.stop_checker import StopChecker
from engine.structured.constrained import ConstrainedRequests
from vocabulary.sampling import SamplingParams
from vocabulary.tokenizer import Tokenizer


class RequestTracking:
    """Stop checkers and seeded generators by request id, and the grammar matchers' owner."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        sampler: Sampler,
        constrained: ConstrainedRequests,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sampler = sampler
        self.constrained = constrained
        self.checkers: dict[str, StopChecker] = {}
        self.generators: dict[str, torch.Generator] = {}
        """Seeded requests' generators, `num_draws_done` draws in (the sampler's rows)."""

    def start(
        self, request: Request, prompt: Sequence[int], params: SamplingParams, num_draws_done: int
    ) -> StopChecker:
        """Track a request whose output follows `prompt`; its checker (to replay a prior)."""
        checker = StopChecker(
            self.tokenizer.detokenizer(prompt), self.eos_token_ids, self.max_model_len
        )
        self.checkers[request.request_id] = checker
        if params.seed is not None:
            self.generators[request.request_id] = self.sampler.make_generator(
                params.seed, num_draws_done
            )
        return checker

    def stop(self, request_id: str) -> None:
        """Forget a request (idempotent): its checker, generator and grammar matcher."""
        self.constrained.stop(request_id)
        self.checkers.pop(request_id, None)
        self.generators.pop(request_id, None)
