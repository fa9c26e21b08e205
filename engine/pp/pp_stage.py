"""Which part of the model a pipeline stage holds, as pure functions.

A worker of `pp_size` stages holds layers [bounds[s], bounds[s + 1]) on stage s
(vocabulary/pipeline.py cuts them). A stage's model is a `LlamaModel` of `stage_config(cfg,
stage)` (its layer count), its layers numbered from 0 locally: local layer i is model layer
`layer_start + i`, so the attention backends, the KV pool (its layers only) and the runner need
no PP awareness. The embedding lives on stage 0 and the final norm and head on the last stage;
a stage without them keeps empty placeholders (`LlamaModel.drop_unused_ends`).

The loaders read a checkpoint through `stage_tensors`: decoder tensors of the stage's layers,
renamed to their local index, and every other tensor (embedding, norm, head), so the
checkpoint's completeness is checked as for a whole model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TypeVar

from vocabulary.model_config import ModelConfig
from vocabulary.pipeline import stage_layer_bounds

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

T = TypeVar("T")


@dataclass(frozen=True)
class PPStage:
    """Stage `rank` of a pipeline of `size` stages cutting the model at `bounds` (size + 1
    boundaries from 0 to the model's layers)."""

    size: int
    rank: int
    bounds: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size or len(self.bounds) != self.size + 1:
            raise ValueError(
                f"pipeline stage {self.rank} of {self.size} with boundaries {self.bounds}"
            )

    @classmethod
    def of(cls, num_layers: int, size: int, rank: int, partition: tuple[int, ...] = ()) -> PPStage:
        """Stage `rank` of `size` over a model of `num_layers` (ValueError naming the numbers
        when the stages do not cut the layers as stated)."""
        return cls(size, rank, stage_layer_bounds(num_layers, size, partition))

    @property
    def layer_start(self) -> int:
        return self.bounds[self.rank]

    @property
    def layer_end(self) -> int:
        return self.bounds[self.rank + 1]

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def layers(self) -> range:
        """The model layers this stage holds."""
        return range(self.layer_start, self.layer_end)

    @property
    def model_layers(self) -> int:
        return self.bounds[-1]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def holds(self, layer: int) -> bool:
        """Whether model layer `layer` is this stage's."""
        return self.layer_start <= layer < self.layer_end


def stage_config(cfg: ModelConfig, stage: PPStage) -> ModelConfig:
    """The config of a stage's model: `cfg` with the stage's layer count (ValueError when
    `stage` does not cut a model of `cfg`'s layers)."""
    if stage.model_layers != cfg.num_layers:
        raise ValueError(
            f"pipeline boundaries {stage.bounds} cut {stage.model_layers} layers; the model "
            f"has {cfg.num_layers}"
        )
    return replace(cfg, num_layers=stage.num_layers)


def stage_tensors(tensors: Iterator[tuple[str, T]], stage: PPStage) -> Iterator[tuple[str, T]]:
    """The (name, tensor) pairs of a checkpoint that a stage's model reads (module
    docstring): its layers' under local names, the others as they are."""
    for name, tensor in tensors:
        m = _LAYER.match(name)
        if m is None:
            yield name, tensor
            continue
        layer = int(m.group(1))
        if stage.holds(layer):
            yield f"model.layers.{layer - stage.layer_start}.{m.group(2)}", tensor
