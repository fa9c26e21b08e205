"""Switch an idle engine to another mode, keeping its weights, KV pool and prefix cache (a
worker's role switch: worker_runtime/role_host.py).

What the mode decides is rebuilt here and nowhere else:

- `config.mode` (a prefill-only request finishes after its first token, `LLMEngine._postprocess`);
- the scheduler's hand-off flags (prefill-only: the finished request keeps its blocks for the
  hand-off, `Scheduler.keep_blocks_on_prefill_finish` / `finish_after_first_token`);
- a split engine's prefill lane and SM partitions (engine/core/prefill_lane.py): built when
  entering split, dropped when leaving it. With CUDA graphs, the decode graphs are captured
  again where the decode loop now runs (a graph runs on the SMs of the stream it was captured
  on): inside the decode partition entering split, on the default stream leaving it.

Everything else is kept: the model, the KV pool and the blocks it caches (a block's hash names
the model, the cache salt and the adapter, never the mode, so a cached prefix stays valid in
every mode), the host tier, the LoRA adapters, the step runner and its TP or pipeline ranks.

Only an idle engine switches (`EngineBusy` otherwise, and nothing changes): nothing waiting or
running, no blocks held for a hand-off, none reserved for a transfer.
"""

from __future__ import annotations

from dataclasses import replace

from engine.config import EngineMode
from engine.core.engine import LLMEngine
from engine.core.prefill_lane import PrefillLane
from engine.core.sm_split import SMSplit


class EngineBusy(Exception):
    """The engine holds requests or blocks for a hand-off: it cannot change its mode now."""


def busy_reason(engine: LLMEngine) -> str | None:
    """What the engine still holds that a mode switch must wait for (None: idle)."""
    s, lane = engine.scheduler, engine.prefill_lane
    held = {
        "unfinished requests": len(s.requests) + (len(lane.scheduler.requests) if lane else 0),
        "hand-offs": len(s.handed_off),
        "transfers": len(s.transferring),
        "outputs not delivered": len(engine._ready),
    }
    parts = [f"{n} {what}" for what, n in held.items() if n]
    return ", ".join(parts) or None


def set_mode(engine: LLMEngine, mode: EngineMode) -> None:
    """Put an idle engine in `mode` (a no-op in the mode it has). Raises `EngineBusy` when it
    holds work, ValueError for a mode its shape refuses (split on several ranks); nothing
    changes either way. Call on the engine's thread."""
    if mode is engine.config.mode:
        return
    if mode is EngineMode.SPLIT and engine.config.num_ranks > 1:
        raise ValueError(
            f"mode: split runs on one device; this engine has {engine.config.num_ranks} ranks"
        )
    config = replace(engine.config, mode=mode)  # the config's own checks, before any change
    if (why := busy_reason(engine)) is not None:
        raise EngineBusy(f"the engine holds {why}: its mode cannot change now")
    if engine._inflight is not None:  # a step of requests that have all ended: wait for it
        engine._complete(engine._inflight)
        engine._inflight = None
    if engine.pipelined is not None:  # (likewise, a pipeline's steps in flight)
        engine.pipelined.drain(engine)
    leaving_split = engine.prefill_lane is not None
    engine.config = config
    prefill_only = mode is EngineMode.PREFILL_ONLY
    engine.scheduler.keep_blocks_on_prefill_finish = prefill_only
    engine.scheduler.finish_after_first_token = prefill_only
    engine._latest_launch = None
    engine.prefill_lane = None
    graphs = engine.runner.graphs
    if mode is EngineMode.SPLIT:
        split = SMSplit(engine.kv_cache.device, config.split_decode_sms)
        with split.decode():
            if graphs is not None and not graphs.captured_here():
                graphs.capture()
        engine.prefill_lane = PrefillLane.build(engine, engine.kv_cache.device, split)
    elif leaving_split and graphs is not None and not graphs.captured_here():
        graphs.capture()
