"""The LoRA slots of a pipeline stage other than rank 0's: filled as rank 0's are.

Rank 0 (stage 0) runs the scheduler and the adapter cache (engine/lora/lora_cache.py): it
decides which adapter sits in which slot, and each chunk of a step names its slot. Every
other stage holds the same slots over its own layers, and agrees on their contents because
it replays rank 0's fills: the step message carries each `LoraFill` rank 0 made since its
previous step, and the stage fills that slot with its layers' part of that adapter before
the step runs (after the steps before it on the device: same stream), so a chunk's slot
holds the same adapter on every stage.

A stage reads an adapter from its folder (the path rank 0 registered: every node of a
pipeline worker must see the same folders, as it sees the same model folder) on its own
loop, and keeps up to `max_cpu_loras` of them in host memory (LRU) so that refilling a slot
reads no disk. A read that fails fails the step (the worker is replaced): rank 0 read the
same folder a moment before.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import torch

from engine.config import EngineConfig
from engine.lora.lora_adapter import LoraAdapter, load_adapter, read_adapter_spec
from engine.lora.lora_apply import LoraWeights
from engine.lora.lora_cache import LoraFill
from engine.lora.lora_registry import cache_sizes
from vocabulary.model_config import ModelConfig


class StageLoras:
    """A pipeline stage's adapter slots (`weights`, read by its runner) and host copies."""

    def __init__(
        self,
        config: EngineConfig,
        model_cfg: ModelConfig,
        layers: range,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`model_cfg`: the whole model's (adapters are checked against it); `layers`: the
        stage's model layers."""
        sizes = cache_sizes(config)
        self.model_cfg = model_cfg
        self.layers = layers
        self.dtype = dtype
        self.max_rank = sizes.max_lora_rank
        self.max_host = sizes.max_cpu_loras
        stage_cfg = replace(model_cfg, num_layers=len(layers))
        # a stage's steps run eager (engine/core/pp_runner.py): no graph kernel to choose
        self.weights = LoraWeights(stage_cfg, sizes.max_loras, sizes.max_lora_rank, dtype, device)
        self._host: OrderedDict[tuple[str, str], LoraAdapter] = OrderedDict()  # LRU first
        self.num_disk_loads = 0

    def fill(self, fill: LoraFill) -> None:
        """Fill `fill.slot` with this stage's layers of its adapter (module docstring);
        raises what reading the folder raised."""
        key = (fill.name, fill.path)
        adapter = self._host.pop(key, None)
        if adapter is None:
            spec = read_adapter_spec(fill.path, self.model_cfg, self.max_rank)
            pin = self.weights.device.type == "cuda"
            adapter = load_adapter(spec, self.model_cfg, self.dtype, pin, self.layers)
            self.num_disk_loads += 1
        self._host[key] = adapter
        while len(self._host) > self.max_host:
            self._host.popitem(last=False)
        self.weights.fill(fill.slot, adapter)
