"""The LoRA adapters one engine serves: its adapter cache (engine/lora/lora_cache.py), or nothing
when LoRA is off. What `LLMEngine.load_lora`, `unload_lora`, `list_loras` and the checks of a
request's adapter do, in one place, so that the engine never branches on LoRA being on.

Rules:
- A name follows `vocabulary.lora_names.check_lora_name` and stands for one folder: registering the
  same name and folder again is a no-op, another folder is refused until the name is
  unloaded (and, while requests still hold the unloaded adapter, until they finish).
- A folder is checked when it is registered (config and tensor shapes against the model,
  rank against max_lora_rank: `engine.lora.lora_adapter.read_adapter_spec`), so a bad adapter fails
  there, as a ValueError naming it, never at its first request.
- A request names a registered adapter ("": the base model): LoraNotFound naming it
  otherwise (saying how to turn LoRA on when it is off), LoraLoadError when its disk read
  failed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.lora.lora_apply import LoraWeights
from engine.lora.lora_cache import AdapterState, LoraCache, LoraCacheConfig, LoraNotFound
from vocabulary.engine_io import LoraInfo
from vocabulary.lora_names import check_lora_name
from vocabulary.model_config import ModelConfig

HELD_STATES = frozenset({AdapterState.HOST, AdapterState.UPLOADING, AdapterState.RESIDENT})
"""States in which the engine holds an adapter's weights (no disk read before it runs)."""
LORA_OFF = "LoRA is not enabled (start with --enable-lora or --lora NAME=PATH)"


def cache_sizes(config: EngineConfig) -> LoraCacheConfig:
    """The adapter cache's sizes an engine of `config` serves with."""
    return LoraCacheConfig(
        max_loras=config.max_loras,
        max_cpu_loras=config.max_cpu_loras,
        max_lora_rank=config.max_lora_rank,
        kernel=config.lora_kernel,
    )


class LoraRegistry:
    """The adapters of one engine (see the module docstring); `cache` is None when LoRA is
    off. Runs on the engine's thread, as the cache does."""

    def __init__(self, cache: LoraCache | None = None) -> None:
        self.cache = cache
        self._paths: dict[str, str] = {}  # each registered name's folder, as it was given

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        model_cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        layers: range | None = None,
    ) -> LoraRegistry:
        """The cache sized by `config` with `config.loras` registered (a ValueError naming
        the first that cannot be served), or an empty registry when LoRA is off. `layers`:
        rank 0's pipeline stage's model layers (its slots hold theirs, and it logs its slot
        fills for the other stages: `LoraCache.mirror`); None: one stage."""
        if not config.lora_enabled:
            return cls()
        cache = LoraCache(model_cfg, cache_sizes(config), dtype, device, layers=layers)
        if layers is not None:
            cache.mirror()
        registry = cls(cache)
        for name, path in config.loras:
            registry.register(name, path)
        return registry

    @property
    def weights(self) -> LoraWeights | None:
        """The device slots the model runner reads (None: LoRA off)."""
        return self.cache.weights if self.cache is not None else None

    def register(self, name: str, path: str) -> None:
        """Serve the PEFT folder at `path` as adapter `name` (nothing is read but its config
        and tensor header). ValueError naming the adapter when LoRA is off, the name is bad
        or taken by another folder, or the folder cannot be served."""
        if self.cache is None:
            raise ValueError(f"lora adapter {name!r}: {LORA_OFF}")
        check_lora_name(name)
        cache = self.cache
        if name in cache.names():
            registered = self._paths[name]
            if Path(path).resolve() == Path(registered).resolve():
                return
            raise ValueError(
                f"lora adapter {name!r} is already loaded from {registered}; unload it first"
            )
        if cache.refs(name):
            raise ValueError(
                f"lora adapter {name!r} is being unloaded ({cache.refs(name)} requests still "
                "hold it); load it again once they finish"
            )
        try:
            cache.register(name, path)
        except (OSError, ValueError) as e:
            raise ValueError(f"lora adapter {name!r}: {e}") from e
        self._paths[name] = path

    def unregister(self, name: str) -> bool:
        """Stop serving `name` (requests holding it keep it until they finish); False if it
        is not registered."""
        if self.cache is None or name not in self.cache.names():
            return False
        self.cache.unregister(name)
        del self._paths[name]
        return True

    def check(self, name: str) -> None:
        """Raise unless a request on adapter `name` can be served here (see the module
        docstring); "" (the base model) always can."""
        if not name:
            return
        if self.cache is None:
            raise LoraNotFound(f"lora adapter {name!r} is not loaded on this worker: {LORA_OFF}")
        if name not in self.cache.names():
            raise LoraNotFound(f"lora adapter {name!r} is not loaded on this worker")
        error = self.cache.load_error(name)
        if error is not None:
            raise error

    def infos(self) -> tuple[LoraInfo, ...]:
        """Every registered adapter, in registration order."""
        if self.cache is None:
            return ()
        cache = self.cache
        return tuple(
            LoraInfo(name, self._paths[name], cache.spec(name).rank, state.value)
            for name, state in self._states()
        )

    def held(self) -> tuple[str, ...]:
        """The registered adapters whose weights are in a device slot or the host cache."""
        return tuple(name for name, state in self._states() if state in HELD_STATES)

    def _states(self) -> list[tuple[str, AdapterState]]:
        if self.cache is None:
            return []
        return [(name, self.cache.state(name)) for name in self.cache.names()]
