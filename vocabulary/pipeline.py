"""How a pipeline-parallel worker cuts a model's layers into stages (pure: no torch).

A worker of `pp_size` stages holds layers [bounds[s], bounds[s + 1]) on stage s, where
`bounds = stage_layer_bounds(num_layers, pp_size, partition)`. Without a partition the stages
are equal and `pp_size` must divide the layers; a partition names each stage's layer count
(vLLM's `VLLM_PP_LAYER_PARTITION`): `pp_size` positive counts that sum to the layers.
The engine (its stage's part of the model and its KV pool), the hand-off plan
(kv_transfer/tp_plan.py: which stage holds a layer) and `pdserve up`'s checks all read it here.
"""

from __future__ import annotations

from collections.abc import Sequence


def stage_layer_bounds(
    num_layers: int, pp_size: int, partition: Sequence[int] = ()
) -> tuple[int, ...]:
    """`pp_size + 1` boundaries from 0 to `num_layers` (stage s: [b[s], b[s+1])); raises
    ValueError naming the numbers when the stages do not cut the layers as stated."""
    if pp_size < 1:
        raise ValueError(f"pipeline stages: must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(
            f"{pp_size} pipeline stages over {num_layers} layers: a stage needs a layer"
        )
    if partition:
        counts = tuple(int(n) for n in partition)
        if len(counts) != pp_size or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(
                f"layer partition {','.join(map(str, counts))}: needs {pp_size} positive "
                f"counts (one per stage) summing to the model's {num_layers} layers"
            )
    else:
        if num_layers % pp_size:
            raise ValueError(
                f"{pp_size} pipeline stages do not divide the model's {num_layers} layers "
                f"(give a layer partition, e.g. {_example(num_layers, pp_size)})"
            )
        counts = (num_layers // pp_size,) * pp_size
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    return tuple(bounds)


def stage_of_layer(bounds: Sequence[int], layer: int) -> int:
    """The stage holding `layer` under `bounds`."""
    if not 0 <= layer < bounds[-1]:
        raise ValueError(f"layer {layer} of a {bounds[-1]}-layer model")
    return next(s for s in range(len(bounds) - 1) if layer < bounds[s + 1])


def _example(num_layers: int, pp_size: int) -> str:
    base, extra = divmod(num_layers, pp_size)
    return ",".join(str(base + (1 if s < extra else 0)) for s in range(pp_size))
