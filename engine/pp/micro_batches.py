"""A step's batch cut into the pipeline's micro-batches (pure: no tensors).

`micro_batches(batch, n)` cuts a `ScheduledBatch` into at most `n` consecutive micro-batches of
about equal token counts, in batch order. A prompt chunk longer than a micro-batch's share is
itself cut into pieces (token ranges of one sequence, each a `SeqChunk` that starts where the
one before ended; only the last piece samples), so one long prefill fills the pipeline too:
stage 0 computes piece k + 1 while stage 1 computes piece k, whose KV stage 1 already holds.
Decodes (one token), placeholders and chunks that return every token's logits are never cut.

Why it keeps outputs exact: a sequence's tokens never read another sequence's, and a piece
reads the KV its earlier pieces wrote on the same stage, as a chunked prefill does; the logit
rows of the micro-batches, concatenated, are those of the whole batch in its order.
"""

from __future__ import annotations

from dataclasses import replace

from engine.batch import ScheduledBatch, SeqChunk
from vocabulary.numeric import cdiv


def micro_batches(batch: ScheduledBatch, n: int) -> tuple[ScheduledBatch, ...]:
    """`batch` in at most `n` micro-batches (module docstring); none for an empty batch."""
    if n < 1:
        raise ValueError(f"micro-batches: must be >= 1, got {n}")
    if not batch.chunks:
        return ()
    share = cdiv(batch.num_tokens, n)
    out: list[ScheduledBatch] = []
    current: list[SeqChunk] = []
    room = share
    for chunk in batch.chunks:
        rest: SeqChunk | None = chunk
        while rest is not None:
            if room <= 0 and current and len(out) < n - 1:
                out.append(ScheduledBatch(tuple(current)))
                current, room = [], share
            if rest.num_tokens <= room or not _cuttable(rest) or len(out) == n - 1:
                current.append(rest)
                room -= rest.num_tokens
                rest = None
                continue
            head, rest = _cut(rest, room)
            current.append(head)
            room = 0
    if current:
        out.append(ScheduledBatch(tuple(current)))
    return tuple(out)


def _cuttable(chunk: SeqChunk) -> bool:
    return chunk.num_tokens > 1 and not chunk.placeholder and not chunk.all_logits


def _cut(chunk: SeqChunk, size: int) -> tuple[SeqChunk, SeqChunk]:
    """(the first `size` tokens of `chunk`, which never samples; the rest)."""
    head = replace(chunk, token_ids=chunk.token_ids[:size], sample=False)
    rest = replace(chunk, token_ids=chunk.token_ids[size:], start_pos=chunk.start_pos + size)
    return head, rest


def logit_row_count(batch: ScheduledBatch) -> int:
    """Rows of logits a runner returns for `batch` (`ScheduledBatch.logit_rows`)."""
    return len(batch.logit_rows()) if batch.has_all_logits else batch.num_sampled
