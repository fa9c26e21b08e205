"""The adapter cache: a few device slots, a larger host LRU, disk reads off the engine thread.

A request names an adapter; the scheduler asks `acquire(name)` for the device slot holding it.
The answer is the slot (the request holds it until `release(name)`), or None: not resident
yet, ask again next step (the request waits in the queue; the step is never blocked). Each
None starts whatever is missing, without waiting for it:

    disk ──(loader thread: read, convert, pin)──▶ host LRU ──(side stream copy)──▶ slot

Lifecycle of one registered adapter (`AdapterState`):

    REGISTERED ─acquire─▶ LOADING ─read done─▶ HOST ─acquire, a slot free─▶ UPLOADING
    UPLOADING ─copy done─▶ RESIDENT ─acquire─▶ (held: refs > 0) ─release─▶ RESIDENT
    RESIDENT ─slot evicted─▶ HOST (host copy kept) or REGISTERED (host LRU dropped it)
    HOST ─host LRU drops it─▶ REGISTERED;   LOADING ─read raised─▶ FAILED

Rules:
- A slot with refs > 0 is never evicted; otherwise the least recently used goes first. A slot
  uploaded for a waiting request is held for it (`hold_seconds` after its latest acquire) so
  that another adapter cannot take it before that request runs (no ping-pong when slots are
  fewer than waiting adapters).
- `unregister` of an adapter that requests hold is deferred: it leaves `names()` at once and
  new acquires fail (LoraNotFound), the holders keep their slot, and the slot is freed at
  the last release.
- Device uploads never race a step: on CUDA they run on a side stream that first waits for
  everything queued so far on the caller's (the step) stream, i.e. every step that may still
  read the slot's previous occupant, and a slot is handed out only once its copy has
  completed (an event query, no wait), so later steps read it complete. On CPU the copy is
  synchronous.
- Not thread-safe: one thread (the engine's) calls every method; the only other thread is
  the cache's own loader, which runs pure reads (`load_adapter`) and touches no state.

A pipeline stage's cache (`layers`: the stage's model layers) holds those layers' part of
every adapter. Rank 0's cache decides the slots for every stage: with `mirror()` on it logs
each slot it fills (`LoraFill`, taken by `take_fills`), and the other stages fill the same
slot with the same adapter before the next step runs (engine/lora/lora_stage.py).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.lora.lora_adapter import (
    DEFAULT_MAX_LORA_RANK,
    LoraAdapter,
    LoraSpec,
    load_adapter,
    read_adapter_spec,
)
from engine.lora.lora_apply import LoraWeights, select_lora_kernel
from vocabulary.engine_io import LoraLoadError, LoraNotFound
from vocabulary.model_config import ModelConfig


class AdapterState(enum.Enum):
    """Where a registered adapter's weights are (transitions: the module docstring)."""

    REGISTERED = "registered"
    LOADING = "loading"
    HOST = "host"
    UPLOADING = "uploading"
    RESIDENT = "resident"
    FAILED = "failed"


@dataclass(frozen=True)
class LoraCacheConfig:
    """Sizes of the adapter cache."""

    max_loras: int = 4
    """Device slots: the most distinct adapters one step can mix."""
    max_cpu_loras: int = 8
    """Adapters kept in host memory (LRU), at least max_loras."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """Largest adapter rank served; slots are padded to it (rounded up to 16)."""
    kernel: str = "auto"
    """LoRA kernel of CUDA-graph decode steps: auto (triton's dot path on CUDA in fp16/bf16 where
    it passes its self-check, else torch), torch (dense over the slots), triton
    (engine/lora/lora_triton.py), flashinfer (segment GEMM)."""
    hold_seconds: float = 2.0
    """How long a slot uploaded for a waiting request is kept for it after its latest
    acquire (then it is evictable like any unheld slot)."""

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")


@dataclass(frozen=True)
class LoraCacheStats:
    """Counters of a LoraCache since it was made."""

    num_disk_loads: int
    """Adapters read from disk (completed reads)."""
    num_host_loads: int
    """Slot uploads served from the host cache (no disk read needed)."""
    num_evictions: int
    """Device slots taken from an unheld adapter for another."""
    num_host_evictions: int
    """Adapters the host LRU dropped."""
    disk_load_seconds: float
    """Total time of the disk reads (on the loader thread)."""
    num_resident: int
    num_host_cached: int


@dataclass(frozen=True)
class LoraFill:
    """Rank 0's cache filled device `slot` with adapter `name`, the PEFT folder at `path`."""

    slot: int
    name: str
    path: str


@dataclass
class _Entry:
    name: str
    spec: LoraSpec
    future: Future[tuple[LoraAdapter, float]] | None = None
    slot: int | None = None
    upload: torch.cuda.Event | None = None
    source: LoraAdapter | None = None  # the host copy an upload in flight reads
    fresh: bool = False  # read from disk and not uploaded since (counted as a disk load)
    refs: int = 0
    hold_until: float = 0.0
    last_used: float = 0.0
    draining: bool = False
    error: BaseException | None = field(default=None, repr=False)


class LoraCache:
    """Registered adapters, their host copies and the device slots (see the module docstring).
    `weights` are the slots' tensors the model reads (allocated once, here)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        config: LoraCacheConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        clock: Callable[[], float] = time.monotonic,
        layers: range | None = None,
    ) -> None:
        """`layers`: a pipeline stage's model layers (its slots hold only theirs); None:
        every layer of `model_cfg`."""
        device = torch.device(device)
        self.model_cfg = model_cfg
        self.config = config
        self.dtype = dtype
        self.device = device
        self.layers = layers
        kernel = select_lora_kernel(config.kernel, device, dtype)
        self.weights = LoraWeights(
            model_cfg if layers is None else replace(model_cfg, num_layers=len(layers)),
            config.max_loras,
            config.max_lora_rank,
            dtype,
            device,
            kernel,
            may_fall_back=config.kernel == "auto",
        )
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # LRU first
        self._owners: list[str | None] = [None] * config.max_loras
        self._loading: dict[str, _Entry] = {}  # disk reads in flight (or done, not collected)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._num_disk_loads = self._num_host_loads = 0
        self._num_evictions = self._num_host_evictions = 0
        self._disk_seconds = 0.0
        self._fills: list[LoraFill] | None = None  # `mirror`: slots filled since `take_fills`

    def mirror(self) -> None:
        """Log every slot fill from now on for the other stages of a pipeline (`take_fills`)."""
        self._fills = []

    def take_fills(self) -> tuple[LoraFill, ...]:
        """The slot fills since the previous call (in order; none unless `mirror`ed)."""
        if not self._fills:
            return ()
        fills, self._fills = tuple(self._fills), []
        return fills

    # ---- registry ---------------------------------------------------------------------------

    def register(self, name: str, path: str | Path) -> LoraSpec:
        """Make adapter `name` (the PEFT folder at `path`) available; nothing is read but its
        config and tensor header, checked now (ValueError naming what is wrong)."""
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        old = self._entries.get(name)
        if old is not None:
            what = f"still held by {old.refs} requests" if old.draining else "already registered"
            raise ValueError(f"LoRA adapter {name!r} is {what}")
        spec = read_adapter_spec(path, self.model_cfg, self.config.max_lora_rank)
        self._entries[name] = _Entry(name, spec)
        return spec

    def unregister(self, name: str) -> None:
        """Forget `name` now, or, while requests hold it, once the last one releases it (it
        leaves `names()` at once either way). LoraNotFound if it is not registered."""
        entry = self._entry(name)
        entry.draining = True
        if entry.refs == 0:
            self._drop(entry)

    def names(self) -> tuple[str, ...]:
        """Registered adapters (not those being unregistered), in registration order."""
        return tuple(n for n, e in self._entries.items() if not e.draining)

    def spec(self, name: str) -> LoraSpec:
        return self._entry(name).spec

    def state(self, name: str) -> AdapterState:
        entry = self._entry(name)
        self._collect()
        if entry.error is not None:
            return AdapterState.FAILED
        if entry.slot is not None:
            pending = entry.upload is not None and not entry.upload.query()
            return AdapterState.UPLOADING if pending else AdapterState.RESIDENT
        if name in self._host:
            return AdapterState.HOST
        return AdapterState.LOADING if entry.future is not None else AdapterState.REGISTERED

    def load_error(self, name: str) -> LoraLoadError | None:
        """Why reading `name` from disk failed (FAILED: until it is registered again), or
        None."""
        entry = self._entry(name)
        self._collect()
        if entry.error is None:
            return None
        return LoraLoadError(f"LoRA adapter {name!r} ({entry.spec.path}): {entry.error}")

    def slot_of(self, name: str) -> int | None:
        """The device slot `name` occupies (resident or uploading), or None."""
        return self._entry(name).slot

    def refs(self, name: str) -> int:
        """How many acquires of `name` are not released yet."""
        entry = self._entries.get(name)
        return 0 if entry is None else entry.refs

    # ---- slots ------------------------------------------------------------------------------

    def acquire(self, name: str) -> int | None:
        """The slot holding `name`, now held by the caller until `release(name)`; or None (not
        resident yet: what is missing has been started; ask again later). Never waits.
        LoraNotFound for an unknown adapter, LoraLoadError when its disk read failed."""
        entry = self._entry(name)
        error = self.load_error(name)
        if error is not None:
            raise error
        now = self._clock()
        entry.last_used = now
        if name in self._host:
            self._host.move_to_end(name)
        if entry.slot is None and not self._start(entry):
            return None
        if entry.upload is not None:
            if not entry.upload.query():
                entry.hold_until = now + self.config.hold_seconds
                return None
            entry.upload = entry.source = None
        entry.refs += 1
        entry.hold_until = 0.0
        return entry.slot

    def release(self, name: str) -> None:
        """Give back one acquire of `name` (the slot becomes evictable at zero holders)."""
        entry = self._entries.get(name)
        if entry is None or entry.refs == 0:
            raise ValueError(f"LoRA adapter {name!r} is not held")
        entry.refs -= 1
        entry.last_used = self._clock()
        if entry.refs == 0 and entry.draining:
            self._drop(entry)

    @property
    def stats(self) -> LoraCacheStats:
        return LoraCacheStats(
            num_disk_loads=self._num_disk_loads,
            num_host_loads=self._num_host_loads,
            num_evictions=self._num_evictions,
            num_host_evictions=self._num_host_evictions,
            disk_load_seconds=self._disk_seconds,
            num_resident=sum(1 for o in self._owners if o is not None),
            num_host_cached=len(self._host),
        )

    def wait_for_loads(self, timeout: float | None = None) -> None:
        """Block until the disk reads started so far are done (start-up preloading, tests;
        never from the step loop)."""
        pending = [e.future for e in self._loading.values() if e.future is not None]
        wait_futures(pending, timeout=timeout)
        self._collect()

    def close(self) -> None:
        """Stop the loader thread (reads in flight are abandoned)."""
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ---- internals --------------------------------------------------------------------------

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None or entry.draining:
            raise LoraNotFound(f"LoRA adapter {name!r} is not registered")
        return entry

    def _start(self, entry: _Entry) -> bool:
        """Move a non-resident adapter on (disk read, or upload into a slot); True once it
        has a slot (its copy may still be in flight)."""
        adapter = self._host.get(entry.name)
        if adapter is None:
            if entry.future is None:
                entry.future = self._loader.submit(self._read, entry.spec)
                self._loading[entry.name] = entry
            return False
        slot = self._free_slot()
        if slot is None:
            return False
        if not entry.fresh:
            self._num_host_loads += 1
        entry.fresh = False
        self._upload(entry, slot, adapter)
        return True

    def _read(self, spec: LoraSpec) -> tuple[LoraAdapter, float]:
        """The loader thread's work: one adapter from disk, and how long it took."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # pinned memory is made in the device's context
            with torch.cuda.device(self.device):
                adapter = load_adapter(spec, self.model_cfg, self.dtype, True, self.layers)
        else:
            adapter = load_adapter(spec, self.model_cfg, self.dtype, layers=self.layers)
        return adapter, time.perf_counter() - t0

    def _collect(self) -> None:
        """Take the finished disk reads into the host cache (or mark them failed)."""
        for entry in list(self._loading.values()):
            future = entry.future
            if future is None or not future.done():
                continue
            del self._loading[entry.name]
            entry.future = None
            if future.cancelled():
                continue
            error = future.exception()
            if error is not None:
                entry.error = error
                continue
            adapter, seconds = future.result()
            self._num_disk_loads += 1
            self._disk_seconds += seconds
            entry.fresh = True
            self._host[entry.name] = adapter
        while len(self._host) > self.config.max_cpu_loras:
            self._host.popitem(last=False)  # an upload in flight keeps its source (_Entry)
            self._num_host_evictions += 1

    def _free_slot(self) -> int | None:
        """A free slot, else the least recently used unheld one (evicted), else None."""
        for slot, owner in enumerate(self._owners):
            if owner is None:
                return slot
        now = self._clock()
        victims = [
            self._entries[owner]
            for owner in self._owners
            if owner is not None
            and self._entries[owner].refs == 0
            and now >= self._entries[owner].hold_until
        ]
        if not victims:
            return None
        victim = min(victims, key=lambda e: e.last_used)
        freed = victim.slot
        assert freed is not None
        victim.slot = victim.upload = victim.source = None
        self._owners[freed] = None
        self._num_evictions += 1
        return freed

    def _upload(self, entry: _Entry, slot: int, adapter: LoraAdapter) -> None:
        self._owners[slot] = entry.name
        entry.slot = slot
        if self._fills is not None:
            self._fills.append(LoraFill(slot, entry.name, str(entry.spec.path)))
        if self._stream is None:
            self.weights.fill(slot, adapter)
            return
        steps_so_far = torch.cuda.Event()
        steps_so_far.record(torch.cuda.current_stream(self.device))
        self._stream.wait_event(steps_so_far)
        with torch.cuda.stream(self._stream):
            self.weights.fill(slot, adapter)
        entry.upload = torch.cuda.Event()
        entry.upload.record(self._stream)
        entry.source = adapter

    def _drop(self, entry: _Entry) -> None:
        """Forget an unheld entry: its slot becomes free, its host copy goes."""
        if entry.future is not None:
            entry.future.cancel()
        self._loading.pop(entry.name, None)
        if entry.slot is not None:
            self._owners[entry.slot] = None
        self._host.pop(entry.name, None)
        del self._entries[entry.name]
