"""LoRA adapters across the cluster: what the controller's `load_lora`, `unload_lora` and
`list_loras` do with its workers.

The cluster's adapter set lives in the controller's spec (`spec.engine.loras`), which every
worker starts with, so a worker started later (a scale-up, a replacement) serves what was
loaded before it. A load first registers the adapter on every listed worker at once (each
reads the folder's `adapter_config.json`: an adapter a worker cannot serve is refused in the
worker's own words and undone where it succeeded), then joins the set; an unload leaves the
set first, then every worker (requests running on it finish there). A worker that became
ready while the set changed is brought in line by `sync_worker`. Every call to a worker has a
deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from router.control import LoraEntry, LoraRefused
from router.errors import unwrap
from vocabulary.engine_io import LoraInfo
from vocabulary.waits import wait_within

LORA_CALL_TIMEOUT_S = 30.0
"""Longest wait for one worker to register, unregister or list adapters."""
HELD_STATES = ("host", "uploading", "resident")
"""Adapter-cache states in which a worker holds an adapter's weights."""


async def _on_each(calls: Mapping[str, Any]) -> dict[str, Any]:
    """Await every worker's call (worker id -> Ray call) within the deadline; each result or
    the exception it raised (Ray's wrapper taken off)."""
    ids = list(calls)
    results = await asyncio.gather(
        *(wait_within(calls[w], LORA_CALL_TIMEOUT_S) for w in ids), return_exceptions=True
    )
    return {
        w: unwrap(r) if isinstance(r, BaseException) else r
        for w, r in zip(ids, results, strict=True)
    }


def _failures(results: Mapping[str, Any]) -> dict[str, BaseException]:
    return {w: r for w, r in results.items() if isinstance(r, BaseException)}


def _describe(failed: Mapping[str, BaseException]) -> str:
    return "; ".join(f"{w}: {e}" for w, e in sorted(failed.items()))


async def register_everywhere(
    handles: Mapping[str, Any], loras: Mapping[str, str], name: str, path: str
) -> None:
    """Register `name` (at `path`) on every worker of `handles`; `loras` is the set before.
    LoraRefused when the name is taken by another path or a worker refuses the adapter (then
    no worker keeps it, unless it was in the set already)."""
    if loras.get(name, path) != path:
        raise LoraRefused(
            f"name: adapter {name!r} is already loaded from {loras[name]}; unload it first"
        )
    results = await _on_each({w: h.load_lora.remote(name, path) for w, h in handles.items()})
    failed = _failures(results)
    if not failed:
        return
    if name not in loras:
        done = {w: handles[w].unload_lora.remote(name) for w in results if w not in failed}
        await _on_each(done)  # best effort: a worker that cannot answer is noticed elsewhere
    raise LoraRefused(f"adapter {name!r} at {path}: {_describe(failed)}")


async def unregister_everywhere(
    handles: Mapping[str, Any], loras: Mapping[str, str], name: str
) -> None:
    """Unregister `name` on every worker of `handles`. LoraRefused(not_found) when neither
    the set nor any worker has it; a worker that fails to answer is named."""
    results = await _on_each({w: h.unload_lora.remote(name) for w, h in handles.items()})
    failed = _failures(results)
    if failed:
        raise LoraRefused(f"unloading {name!r}: {_describe(failed)}")
    if name not in loras and not any(results.values()):
        raise LoraRefused(f"name: no adapter {name!r} is loaded", not_found=True)


async def list_everywhere(handles: Mapping[str, Any], loras: Mapping[str, str]) -> list[LoraEntry]:
    """The adapters of the set (and any a worker has that the set lost), with the workers
    that have each registered and those holding its weights. A worker that cannot answer is
    left out of the lists."""
    results = await _on_each({w: h.list_loras.remote() for w, h in handles.items()})
    infos: dict[str, list[tuple[str, LoraInfo]]] = {name: [] for name in loras}
    for worker, answer in results.items():
        if isinstance(answer, BaseException):
            continue
        for info in answer:
            infos.setdefault(info.name, []).append((worker, info))
    entries = []
    for name, held in sorted(infos.items()):
        rank = max((i.rank for _, i in held), default=0)
        path = loras.get(name) or (held[0][1].path if held else "")
        entries.append(
            LoraEntry(
                name=name,
                path=path,
                rank=rank,
                workers=tuple(sorted(w for w, _ in held)),
                loaded_on=tuple(sorted(w for w, i in held if i.state in HELD_STATES)),
            )
        )
    return entries


async def sync_worker(handle: Any, loras: Mapping[str, str]) -> str:
    """Bring one worker's adapters to `loras` (loads the missing, unloads the extra): the set
    may have changed while it started. Returns what it did ("" when nothing)."""
    have = {
        i.name: i.path for i in await wait_within(handle.list_loras.remote(), LORA_CALL_TIMEOUT_S)
    }
    done = []
    for name, path in loras.items():
        if have.get(name) != path:
            if name in have:
                await wait_within(handle.unload_lora.remote(name), LORA_CALL_TIMEOUT_S)
            await wait_within(handle.load_lora.remote(name, path), LORA_CALL_TIMEOUT_S)
            done.append(f"loaded {name}")
    for name in have.keys() - loras.keys():
        await wait_within(handle.unload_lora.remote(name), LORA_CALL_TIMEOUT_S)
        done.append(f"unloaded {name}")
    return ", ".join(done)
