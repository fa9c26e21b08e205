"""TEST-ONLY fault injection: a decode worker whose KV reads complete only while a gate is open.

With the gate closed, a read that NIXL has finished still polls as in progress, so the
transfer stays TRANSFERRING (holding its share of the in-flight budget, so later transfers
stay QUEUED) until the gate opens or the transfer is cancelled. Everything else is the real
`DecodeWorker`: the real engine, endpoint, NIXL agent and cancellation paths.
"""

from __future__ import annotations

import sys
import threading
from types import ModuleType

from decode_worker.worker import DecodeWorker
from kv_transfer.backend import XferId, XferStatus
from vocabulary.worker_api import WorkerInfo


class GatedDecodeWorker(DecodeWorker):
    async def start(self) -> WorkerInfo:
        info = await super().start()
        self._gate = threading.Event()
        self._gate.set()
        manager = self._endpoint._manager
        assert manager is not None
        backend = manager.backend
        real_poll = backend.poll
        gate = self._gate

        def gated_poll(xfer: XferId) -> XferStatus:  # the transfer thread
            status = real_poll(xfer)
            if status is XferStatus.DONE and not gate.is_set():
                return XferStatus.IN_PROGRESS
            return status

        backend.poll = gated_poll  # type: ignore[method-assign]
        return info

    def close_gate(self) -> None:
        self._gate.clear()

    def open_gate(self) -> None:
        self._gate.set()


def gated_module() -> ModuleType:
    return sys.modules[__name__]
