"""The host KV tier of a pipeline stage other than rank 0's: rank 0's copies, replayed.

Rank 0's `HostTier` (engine/kv/host_tier.py) decides every move of the worker's host tier; the
block ids and host slot ids are the same on every stage. Mirrored, it logs each copy it
queues (`HostCopy`), and each step message carries those made since rank 0's previous step
(engine/core/pp_runner.py). A stage replays them in order (`apply`) before it runs that step,
on its own pool (its layers) and its own host blocks (the same slots), so every stage holds
its part of the same blocks as rank 0.

Order on a GPU, as rank 0's: onboards are queued on the step stream (the step reading the
blocks runs after them); offloads (rank 0 makes them at `flush`, just before launching the
step) on a side stream that first waits for everything queued on the step stream, so they
overlap the step. A block such an offload reads is cached and unused, but it may be evicted
and rewritten by a later step: each `apply` first makes the step stream wait for the
offloads of earlier messages (they have had a step to finish; this message's never read a
block the step writes, since rank 0 withdraws an offer whose block it reallocates). On CPU
every copy is synchronous.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.block_mover import stream_movers
from engine.kv.host_tier import HostCopy, host_blocks, offload_beside


class StageHostTier:
    """A stage's host blocks, written and read only by replayed copies (module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        device_kv: torch.Tensor,
        block_dim: int = 0,
        max_blocks_per_step: int = 256,
    ) -> None:
        """`device_kv`: the stage's pool tensor, its block ids indexing `block_dim`;
        `max_blocks_per_step`: rank 0's (a move's largest size: the staging buffers')."""
        if num_blocks <= 0:
            raise ValueError(f"host tier num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.tensor = host_blocks(device_kv, num_blocks, block_dim)
        # the step stream's mover (onboards), the side stream's (offloads)
        self._movers = stream_movers(device_kv, self.tensor, block_dim, max_blocks_per_step)
        device = device_kv.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: list[torch.cuda.Event] = []  # side-stream offloads of earlier messages
        self.num_offloaded = self.num_onboarded = 0

    def apply(self, copies: Sequence[HostCopy]) -> None:
        """Replay rank 0's copies of one step message, in order, before its step runs."""
        if self._stream is not None:
            main = torch.cuda.current_stream(self._stream.device)
            for event in self._pending:
                main.wait_event(event)
            self._pending.clear()
        for copy in copies:
            if copy.offload:
                self._offload(copy.pairs)
            else:
                self._movers[0].to_device([(slot, b) for b, slot in copy.pairs])
                self.num_onboarded += len(copy.pairs)

    def _offload(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.num_offloaded += len(pairs)
        if self._stream is None:
            self._movers[0].to_host(pairs)
            return
        self._pending.append(offload_beside(self._stream, self._movers[1], pairs))
