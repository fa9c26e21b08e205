"""Typed errors of the KV transfer path.

Every way a hand-off can end badly has its own type, so the worker can decide (re-prefill,
fail the request, drop a peer) and the router can map it to one gRPC status in one place.
`TransferError` is the base of all of them: catching it catches every transfer failure.
"""

from __future__ import annotations


class TransferError(Exception):
    """A KV transfer did not complete; the destination blocks were (or will be) freed."""


class TransferTimeout(TransferError):
    """The transfer's deadline passed while it was queued or in flight."""


class LeaseExpired(TransferError):
    """The prefill lease ended (or was about to) before the blocks could be pulled."""


class HandshakeError(TransferError):
    """Two endpoints cannot talk: protocol version or KV compatibility hash differ."""


class UnknownPeer(TransferError):
    """A `KVHandle` names a prefill agent this decode endpoint has no handshake with."""


class PeerLost(TransferError):
    """The prefill peer disconnected (process died, agent removed) during the hand-off."""


class TransferCancelled(TransferError):
    """The worker cancelled the transfer, or the endpoint was closed."""


class BackendError(TransferError):
    """The transfer library reported an error; `peer_lost` says whether the peer is gone."""

    def __init__(self, message: str, *, peer_lost: bool = False) -> None:
        super().__init__(message)
        self.peer_lost = peer_lost
