"""vocabulary/pipeline.py: how a pipeline-parallel worker's stages cut the layers, and the KV
pool spec of one stage."""

from __future__ import annotations

import pytest

from engine.kv.kv_cache import KVCacheSpec
from vocabulary.pipeline import stage_layer_bounds, stage_of_layer


def test_equal_stages_and_a_partition() -> None:
    assert stage_layer_bounds(32, 1) == (0, 32)
    assert stage_layer_bounds(32, 4) == (0, 8, 16, 24, 32)
    assert stage_layer_bounds(32, 3, (10, 11, 11)) == (0, 10, 21, 32)
    stages = [stage_of_layer((0, 10, 21, 32), i) for i in (0, 9, 10, 20, 21, 31)]
    assert stages == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    ("layers", "pp", "partition", "message"),
    [
        (32, 3, (), "3 pipeline stages do not divide the model's 32 layers .*11,11,10"),
        (2, 4, (), "4 pipeline stages over 2 layers"),
        (32, 2, (10, 20), "layer partition 10,20: needs 2 positive counts .* 32 layers"),
        (32, 2, (32, 0), "layer partition 32,0"),
        (32, 0, (), "must be >= 1, got 0"),
    ],
)
def test_a_cut_that_does_not_fit_names_the_numbers(
    layers: int, pp: int, partition: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        stage_layer_bounds(layers, pp, partition)


def test_a_stage_pool_names_its_layers_of_the_model() -> None:
    spec = KVCacheSpec(4, 16, 16, 8, 128, "bfloat16", pp_size=2, pp_rank=1, layer_start=16,
                       model_layers=32)  # fmt: skip
    assert (spec.num_layers, spec.total_layers) == (16, 32)
    assert KVCacheSpec(4, 16, 16, 8, 128, "bfloat16").total_layers == 16
    with pytest.raises(ValueError, match=r"layers \[24, 40\) of a model with 32"):
        KVCacheSpec(4, 16, 16, 8, 128, "bfloat16", pp_size=2, pp_rank=1, layer_start=24,
                    model_layers=32)  # fmt: skip
    with pytest.raises(ValueError, match="pipeline stage 2 of 2"):
        KVCacheSpec(4, 16, 16, 8, 128, "bfloat16", pp_size=2, pp_rank=2, model_layers=32)
