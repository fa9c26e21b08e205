"""The Ray actor every cluster worker is: one engine, serving whichever role it has now.

`RoleHost` holds one role object (a `WorkerLifecycle`: the prefill worker, the decode worker,
which also serves the colocated and split roles) and hands it every call; the role objects
share the host's one `WorkerRuntime`, so the engine, its weights and its KV pool (and the
prefix blocks it caches) outlive a change of role. The role classes are given by whoever
creates the actor (deploy/control/worker_actors.py `ROLE_CLASSES`): this floor imports none.

A role switch (`switch_role`) is a lifecycle transition, not a restart:

    READY(A) ──switch_role(B)──► DRAINING(A): admits nothing; its requests, token streams
        and leases finish (decode workers still pull a prefill worker's leased blocks)
      ──A holds nothing──► flip: A's KV endpoint and token channels close, the engine
        changes its mode (engine/core/mode_switch.py), B's endpoint opens on the same pool
      ──► READY(B)
    DRAINING(A) ──drain timeout──► READY(A): undrained, nothing changed (`switched` False)

The worker reports its role in `load()` (and `info()`): routers stop placing A's work when its
state leaves READY, before the drain, and place B's only once it reports READY as B, after
the flip. A call of a role the worker does not serve now raises `WorkerDraining` (a router
that has not seen the switch yet places the request elsewhere). Refused at once with
`RoleSwitchRefused`, nothing changed: the role it has, a worker that is not READY (draining,
switching, stopping), a role its shape cannot run (split on several ranks). A flip that fails
puts the old role back; when even that fails the worker reports itself unhealthy (`ping`) and
the controller replaces it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from engine.config import EngineMode
from engine.core.mode_switch import EngineBusy, set_mode
from kv_transfer.config import KVTransferConfig
from vocabulary.tracing import FinishedSpan
from vocabulary.worker_api import (
    RoleSwitch,
    RoleSwitchRefused,
    WorkerDraining,
    WorkerInfo,
    WorkerRole,
    WorkerState,
    WorkerUnhealthy,
)
from worker_runtime.lifecycle import WorkerLifecycle
from worker_runtime.runtime import WorkerConfig, WorkerRuntime, engine_mode

log = logging.getLogger(__name__)

MODE_WAIT_S = 5.0
"""Longest a flip waits for the engine to finish what the drained role left on its thread."""

RoleClasses = Mapping[WorkerRole, type[WorkerLifecycle[Any]]]
"""The class that serves each role (the decode worker's serves decode, colocated and split)."""


class RoleHost:
    """Ray actor class of a worker whose role can change (see the module docstring)."""

    def __init__(
        self,
        config: WorkerConfig,
        transfer: KVTransferConfig,
        actor_name: str = "",
        followers: Sequence[Any] = (),
        roles: RoleClasses | None = None,
    ) -> None:
        if not roles or config.role not in roles:
            raise ValueError(f"roles: no class serves the {config.role.value} role")
        self._roles = dict(roles)
        self._transfer = transfer
        self.role: WorkerLifecycle[Any] = roles[config.role](
            config, transfer, actor_name, followers
        )
        self._switching: WorkerRole | None = None
        self._broken = ""

    # ---- what the role's objects hold ------------------------------------------------------

    @property
    def runtime(self) -> WorkerRuntime:
        return self.role.runtime

    @property
    def endpoint(self) -> Any:
        return self.role.endpoint

    def _serving(self, name: str) -> Callable[..., Any]:
        """The current role's method `name`; `WorkerDraining` when the role has none."""
        method = getattr(self.role, name, None)
        if method is None:
            rt = self.runtime
            raise WorkerDraining(
                f"worker {rt.config.worker_id} serves the {rt.config.role.value} role now: "
                f"no {name} here"
            )
        return method

    # ---- lifecycle (the role's) ------------------------------------------------------------

    async def start(self) -> WorkerInfo:
        return await self.role.start()

    def info(self) -> WorkerInfo:
        return self.role.info()

    def ping(self) -> str:
        if self._broken:
            raise WorkerUnhealthy(f"worker {self.runtime.config.worker_id}: {self._broken}")
        return self.role.ping()

    async def drain(self, timeout_s: float = 60.0) -> bool:
        return await self.role.drain(timeout_s)

    def undrain(self) -> None:
        if self._switching is None:  # a switch undrains (or not) itself
            self.role.undrain()

    async def shutdown(self) -> None:
        await self.role.shutdown()

    def load(self) -> Any:
        return self.role.load()  # type: ignore[attr-defined]

    async def abort(self, request_id: str) -> bool:
        return bool(await self._serving("abort")(request_id))

    async def load_lora(self, name: str, path: str) -> Any:
        return await self.role.load_lora(name, path)

    async def unload_lora(self, name: str) -> bool:
        return await self.role.unload_lora(name)

    async def list_loras(self) -> Any:
        return await self.role.list_loras()

    def finished_spans(self, clear: bool = False) -> list[FinishedSpan]:
        return self.role.finished_spans(clear)

    # ---- the prefill role's calls ----------------------------------------------------------

    def handshake_info(self) -> Any:
        return self._serving("handshake_info")()

    async def prefill(self, req: Any) -> Any:
        return await self._serving("prefill")(req)

    # ---- the decode roles' calls -----------------------------------------------------------

    async def submit(self, req: Any, channel_id: str) -> None:
        await self._serving("submit")(req, channel_id)

    async def subscribe(self, channel_id: str, lease_s: float | None = None) -> AsyncIterator[Any]:
        async for batch in self._serving("subscribe")(channel_id, lease_s):
            yield batch

    async def generate(self, req: Any) -> AsyncIterator[Any]:
        async for chunk in self._serving("generate")(req):
            yield chunk

    def renew(self, channel_id: str) -> bool:
        """False when the worker holds no such channel (it serves no decode role now)."""
        renew = getattr(self.role, "renew", None)
        return bool(renew(channel_id)) if renew is not None else False

    def channels(self) -> list[Any]:
        channels = getattr(self.role, "channels", None)
        return list(channels()) if channels is not None else []

    def transfer_stats(self) -> Any:
        return self._serving("transfer_stats")()

    # ---- role switch -----------------------------------------------------------------------

    def switch_refusal(self, role: WorkerRole) -> str | None:
        """Why this worker cannot switch to `role` now (None: it can)."""
        rt = self.runtime
        wid, have = rt.config.worker_id, rt.config.role
        if self._switching is not None:
            return f"{wid} is switching to {self._switching.value} already"
        if role is have:
            return f"{wid} is a {have.value} worker already"
        if role not in self._roles:
            return f"role: {role.value} is not a role this worker can serve"
        if rt.state is not WorkerState.READY:
            return f"{wid} is {rt.state.value}: only a ready worker switches"
        if role is WorkerRole.SPLIT and rt.config.engine.num_ranks > 1:
            return (
                f"{wid} runs on {rt.config.engine.num_ranks} ranks; a split worker runs on one "
                "device"
            )
        return None

    async def switch_role(self, role: WorkerRole, timeout_s: float = 60.0) -> RoleSwitch:
        """Drain the current role, flip, admit as `role` (module docstring). Raises
        `RoleSwitchRefused` (nothing changed) for what `switch_refusal` names."""
        if (why := self.switch_refusal(role)) is not None:
            raise RoleSwitchRefused(why)
        old, rt = self.role, self.runtime
        was, wid = rt.config.role, rt.config.worker_id
        mode = engine_mode(role)
        config = replace(rt.config, role=role, engine=replace(rt.config.engine, mode=mode))
        self._switching = role
        try:
            held = _held(old)
            t0 = time.perf_counter()
            if not await old.drain(timeout_s):
                old.undrain()
                message = (
                    f"{wid} still held {_held(old)} requests after {timeout_s:g}s; it stays "
                    f"{was.value}, admitting again"
                )
                return RoleSwitch(False, old.info(), message, held, time.perf_counter() - t0)
            t1 = time.perf_counter()
            await self._flip(old, config)
            rt.state = WorkerState.READY
            drain_s, flip_s = t1 - t0, time.perf_counter() - t1
        finally:
            self._switching = None
        message = (
            f"{wid} switched from {was.value} to {role.value} (drained {held} requests in "
            f"{drain_s:.2f}s, flipped in {flip_s:.2f}s)"
        )
        log.info(message)
        return RoleSwitch(True, self.role.info(), message, held, drain_s, flip_s)

    async def _flip(self, old: WorkerLifecycle[Any], config: WorkerConfig) -> None:
        """Close `old`, change the engine's mode, open the role of `config` on the same
        runtime; on failure, open `old`'s role again (or mark the worker broken)."""
        rt = self.runtime
        before = rt.config
        await old.close_role()
        try:
            await self._set_mode(config.engine.mode)
            new = self._roles[config.role](config, self._transfer, rt.actor_name, takes_over=old)
            await new.open_role()
        except Exception as e:
            log.exception("role switch of %s failed; restoring %s", before.worker_id, before.role)
            try:
                await self._set_mode(before.engine.mode)
                rt.config = before
                await old.open_role()
            except Exception as again:
                self._broken = f"a failed role switch left no role ({again})"
                raise
            rt.state = WorkerState.READY
            raise RoleSwitchRefused(f"{before.worker_id}: the switch failed ({e}); "
                                    f"it serves {before.role.value} again") from e  # fmt: skip
        assert rt.info is not None
        rt.info = replace(rt.info, role=config.role)
        self.role = new

    async def _set_mode(self, mode: EngineMode) -> None:
        """Change the engine's mode, waiting (up to `MODE_WAIT_S`) for what the old role posted
        to the engine thread just before it went idle (a lease's release, a last output)."""
        give_up = time.monotonic() + MODE_WAIT_S
        while True:
            try:
                await self.runtime.call(lambda e: set_mode(e, mode))
                return
            except EngineBusy:
                if time.monotonic() >= give_up:
                    raise
                await asyncio.sleep(0.01)


def _held(role: WorkerLifecycle[Any]) -> int:
    """Requests (and a prefill worker's leases) the role holds."""
    return int(role.load().requests_held)  # type: ignore[attr-defined]
