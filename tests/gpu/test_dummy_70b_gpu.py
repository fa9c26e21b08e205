"""A Llama-3-70B shape with FP8 dummy weights on one GPU (`pdserve make-model --preset
llama3-70b --config-only`, `--load-format dummy --quantization fp8`): built layer by layer
straight into FP8, so the device never holds the 140 GB of bf16 weights; the logits are
finite; an engine sizes its KV pool in the memory left and generates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deploy.checkpoints.make_model import make_model
from engine.loading.loaders import load_model
from engine.modeling.llama import causal_attend

pytestmark = pytest.mark.gpu

GIB = 1 << 30


@pytest.fixture(scope="module")
def llama70b_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("l70") / "llama3-70b", "llama3-70b", config_only=True)


def test_llama3_70b_fp8_dummy_fits_one_gpu_and_gives_finite_logits(
    llama70b_config: Path,
) -> None:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = load_model(
        llama70b_config, torch.bfloat16, "cuda", quantization="fp8", load_format="dummy"
    )
    peak = torch.cuda.max_memory_allocated() - base
    assert model.quantization == "fp8"
    # 80 layers x 0.856 G e4m3 projection weights + bf16 embeddings and head (2 x 2.1 GB)
    assert 70e9 < model.weight_bytes < 75e9
    # the largest transient: one embedding drawn in float32 (4.2 GB) beside the weights
    assert peak < model.weight_bytes + 6 * GIB, peak / GIB
    ids = torch.arange(1, 33, device="cuda")
    attend = causal_attend(1, 32, model.cfg.num_heads, model.cfg.num_kv_heads)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, torch.arange(32, device="cuda"), attend))
    assert logits.shape == (32, 128256) and bool(logits.isfinite().all())
    assert float(logits.std()) > 0.1
    del model, logits
    torch.cuda.empty_cache()


def test_an_engine_serves_the_70b_fp8_dummy_model_with_its_kv_pool_in_the_rest(
    llama70b_config: Path,
) -> None:
    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from vocabulary.sampling import SamplingParams

    config = EngineConfig(
        model_dir=str(llama70b_config), quantization="fp8", load_format="dummy",
        attention_backend="torch", layer_ops="torch", cuda_graphs=False,
        max_num_batched_tokens=512, max_num_seqs=8,
    )  # fmt: skip
    engine = LLMEngine(config)
    free, total = torch.cuda.mem_get_info()
    # an H200 (141 GB) keeps more than 20 GiB of KV beside the FP8 weights, memory that the
    # bf16 weights alone would overflow; an 80 GB card keeps a few GiB (4.8 on an H100)
    want = 20 * GIB if total > 120 * GIB else 2 * GIB
    assert engine.kv_cache.spec.nbytes > want, engine.kv_cache.spec.nbytes / GIB
    (tokens,) = engine.generate(
        [list(range(1, 64))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    assert len(tokens) == 4
    print(
        f"70B FP8 dummy: weights {engine.model.weight_bytes / GIB:.1f} GiB, KV pool "
        f"{engine.kv_cache.spec.nbytes / GIB:.1f} GiB ({engine.kv_cache.spec.dtype}), "
        f"free {free / GIB:.1f} of {total / GIB:.1f} GiB"
    )
