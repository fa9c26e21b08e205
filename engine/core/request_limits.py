"""What an engine can take: the checks a request passes before anything is queued, each
naming the field it refuses (the router's gRPC/HTTP errors carry the message)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vocabulary.engine_io import PriorOutput
from vocabulary.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """An engine's bounds on one request: vocabulary, context length and pool size."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    chunked_prefill: bool

    def check_prompt(self, prompt: Sequence[int], params: SamplingParams | None) -> None:
        """ValueError unless the prompt can be served here (`params`: None for a transfer,
        whose output length the prefill side already checked)."""
        if not prompt:
            raise ValueError("prompt_token_ids: must not be empty")
        vocab = self.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: id {bad[0]} is outside [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(prompt)} tokens leave no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if len(prompt) + 1 > self.num_blocks * self.block_size:
            raise ValueError(
                f"prompt_token_ids: {len(prompt)} tokens do not fit the KV pool "
                f"({self.num_blocks} blocks of {self.block_size})"
            )
        if params is not None:
            biased = [t for t, _ in params.logit_bias if t >= vocab]
            if biased:
                raise ValueError(f"logit_bias: token id {biased[0]} is outside [0, {vocab})")
        budget = self.max_num_batched_tokens
        if (
            params is not None
            and not self.chunked_prefill
            and len(prompt) + params.max_tokens - 1 > budget
        ):
            raise ValueError(
                f"prompt_token_ids: {len(prompt)} tokens + max_tokens exceed "
                f"max_num_batched_tokens={budget} with chunked prefill disabled"
            )

    def check_prior(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        prior: PriorOutput,
        with_next: bool = False,
    ) -> None:
        """A prior output leaves the request unfinished (it did not stop on the engine that
        produced it): room for one more token (after `with_next`, the client's last one)."""
        n = len(prior.token_ids) + (1 if with_next else 0)
        if not prior.token_ids:
            return
        bad = [t for t in prior.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prior: token id {bad[0]} is outside [0, {self.vocab_size})")
        if n >= params.max_tokens:
            raise ValueError(f"prior: {n} tokens leave none of max_tokens={params.max_tokens}")
        if len(prompt) + n >= self.max_model_len:
            raise ValueError(
                f"prior: {len(prompt)} prompt + {n} output tokens leave no room within "
                f"max_model_len={self.max_model_len}"
            )
