"""What the scheduler hands the model runner for one step.

The scheduler decides, the runner computes: a `ScheduledBatch` says, per sequence, which
tokens get their KV computed this step, where they sit (start position) and which blocks hold
the sequence (its block table), and whether the last token's logits are needed for sampling.
The runner never allocates or frees blocks; the scheduler never touches tensors.

Slot of the token at position p of a sequence: block_ids[p // block_size] * block_size
+ p % block_size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class HasPromptLength(Protocol):
    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step."""

    request_id: str
    token_ids: tuple[int, ...]
    """Tokens whose KV is computed now (a prompt chunk, or the one newest token of a decode)."""
    start_pos: int
    """Position of token_ids[0]; positions [0, start_pos) are already in the KV cache."""
    block_ids: tuple[int, ...]
    """The sequence's block table; covers at least start_pos + len(token_ids) tokens."""
    sample: bool
    """Return logits for the last token of this chunk (false for non-final prompt chunks)."""
    placeholder: bool = False
    """The chunk is one token whose value the previous step is still sampling (overlap
    scheduling): token_ids holds 0 in its place and the runner takes the token from that
    step's sampled ids on the device (`ModelRunner.keep_sampled`)."""
    lora_slot: int = -1
    """The LoRA device slot every token of the chunk reads (`LoraCache.acquire`), or -1 for
    the base model."""
    all_logits: bool = False
    """Return logits for every token of this chunk, not only the sampled last one (a prompt
    whose request asked for prompt logprobs)."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: prefill chunks first, then single-token decodes."""

    chunks: tuple[SeqChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_sampled(self) -> int:
        return sum(1 for c in self.chunks if c.sample)

    @property
    def has_all_logits(self) -> bool:
        return any(c.all_logits for c in self.chunks)

    def logit_rows(self) -> list[int]:
        """Rows of the step's tokens whose logits `ModelRunner.execute` returns, in batch
        order: every token of an `all_logits` chunk, the last token of another sampled one."""
        rows: list[int] = []
        at = 0
        for c in self.chunks:
            if c.all_logits:
                rows += range(at, at + c.num_tokens)
            elif c.sample:
                rows.append(at + c.num_tokens - 1)
            at += c.num_tokens
        return rows

    @property
    def is_decode_only(self) -> bool:
        """Every chunk is one token with cached context (eligible for CUDA-graph replay)."""
        return all(c.num_tokens == 1 for c in self.chunks)

    def shape(self, requests: Mapping[str, HasPromptLength]) -> tuple[int, int, int]:
        """(requests, prompt tokens, generated tokens) of the batch (the engine's step meter);
        `requests`: the scheduler's, by id."""
        prefill = decode = 0
        for chunk in self.chunks:
            prompt_len = requests[chunk.request_id].num_prompt_tokens
            in_prompt = max(0, min(chunk.num_tokens, prompt_len - chunk.start_pos))
            prefill += in_prompt
            decode += chunk.num_tokens - in_prompt
        return len(self.chunks), prefill, decode
