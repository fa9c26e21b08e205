"""engine: model, paged KV block pool, scheduler, sampler, runner and the `LLMEngine` loop.

Re-exports are lazy: the router imports `engine.block_hash`, `engine.tokenizer` and
`engine.sampling_params` and must not pay for importing torch, so nothing heavy is imported
until one of the names below is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLMEngine": "engine.engine",
    "EngineConfig": "engine.config",
    "EngineMode": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "SamplingParamsError": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "KVHandoff": "engine.outputs",
    "TransferAllocation": "engine.outputs",
    "EngineLoad": "engine.outputs",
    "FinishReason": "engine.request",
    "RequestTimings": "engine.request",
    "Tokenizer": "engine.tokenizer",
    "BlockHash": "engine.block_hash",
    "NoFreeBlocksError": "engine.block_pool",
}

__all__ = [
    "BlockHash",
    "EngineConfig",
    "EngineLoad",
    "EngineMode",
    "FinishReason",
    "KVHandoff",
    "LLMEngine",
    "NoFreeBlocksError",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "SamplingParamsError",
    "Tokenizer",
    "TransferAllocation",
]

if TYPE_CHECKING:
    from engine.block_hash import BlockHash
    from engine.block_pool import NoFreeBlocksError
    from engine.config import EngineConfig, EngineMode
    from engine.engine import LLMEngine
    from engine.outputs import EngineLoad, KVHandoff, RequestOutput, TransferAllocation
    from engine.request import FinishReason, RequestTimings
    from engine.sampling_params import SamplingParams, SamplingParamsError
    from engine.tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
