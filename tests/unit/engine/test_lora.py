"""Multi-LoRA serving on CPU: PEFT adapters made by `peft` on the tiny model, served by the
ModelRunner with the adapter cache, against `peft`'s own PeftModel in transformers (float32).

Covers the adapter format (what loads, what is refused and how the error names it), the
batched apply (three adapters of different ranks and targets plus base rows in one step, each
row equal to its own reference; the graph kernels equal the grouped one), FP8 projections
with an adapter, and the cache (LRU eviction, held slots, host hits vs disk reads, deferred
unregister, failed reads: test_lora_cache.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from lora_cases import acquire_now, edited_copy, make_adapters, make_cache
from lora_reference import ATTENTION, MLP, hf_base, peft_model
from runner_factories import corpus_tokens, make_pool, prompt_tokens, scattered_blocks

from engine.batch import ScheduledBatch, SeqChunk
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.loading.loaders import load_model
from engine.lora.lora_adapter import WEIGHTS_FILE, read_adapter_spec
from engine.lora.lora_apply import LoraWeights, eager_step, graph_step
from engine.lora.lora_cache import (
    LoraCache,
    LoraCacheConfig,
    LoraLoadError,
)
from engine.modeling.llama import DecoderLayer, LlamaModel
from vocabulary.model_config import ModelConfig
from vocabulary.sampling import SamplingParams

RTOL, ATOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def peft_models(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    """name → peft's PeftModel of that adapter; "base" → the plain transformers model."""
    out = {n: peft_model(tiny_model_dir, p) for n, p in adapters.items()}
    out["base"] = hf_base(tiny_model_dir)
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LlamaModel:
    return load_model(tiny_model_dir, torch.float32)


@pytest.fixture(scope="module")
def corpus(tiny_model_dir: Path) -> list[int]:
    return corpus_tokens(tiny_model_dir)


def lora_runner(model: LlamaModel, model_dir: Path, cache: LoraCache) -> ModelRunner:
    config = EngineConfig(model_dir=str(model_dir), block_size=16, cuda_graphs=False)
    return ModelRunner(model, make_pool(model), config, lora_weights=cache.weights)


@torch.inference_mode()
def reference(hf: Any, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()


def chunk(rid: str, tokens: list[int], start: int, blocks: tuple[int, ...], slot: int) -> SeqChunk:
    return SeqChunk(rid, tuple(tokens), start, blocks, sample=True, lora_slot=slot)


# ---- the adapter format -------------------------------------------------------------------


def test_spec_reads_rank_scaling_and_targets(model: LlamaModel, adapters: dict[str, Path]) -> None:
    qv = read_adapter_spec(adapters["qv8"], model.cfg)
    assert (qv.rank, qv.scaling, qv.modules) == (8, 2.0, ("q_proj", "v_proj"))
    assert qv.layers == (tuple(range(model.cfg.num_layers)),) * 2
    mlp = read_adapter_spec(adapters["mlp4"], model.cfg)
    assert (mlp.rank, mlp.scaling, mlp.modules) == (4, 4.0, tuple(MLP))  # rslora: 8 / sqrt(4)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"bias": "all"}, "bias='all'"),
        ({"use_dora": True}, "use_dora"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules: 'lm_head'"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"r": 4}, "has shape (8, 128), want (4, 128)"),
    ],
)
def test_a_config_the_engine_cannot_serve_is_refused_naming_the_field(
    model: LlamaModel, adapters: dict[str, Path], tmp_path: Path, fields: dict, named: str
) -> None:
    bad = edited_copy(adapters["qv8"], tmp_path / "bad", **fields)
    with pytest.raises(ValueError, match=str(bad)) as info:
        read_adapter_spec(bad, model.cfg)
    assert named in str(info.value)


def test_a_rank_above_the_maximum_is_refused(model: LlamaModel, adapters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"r=16 is above .*max_lora_rank=8"):
        read_adapter_spec(adapters["all16"], model.cfg, max_rank=8)


def test_a_missing_file_or_folder_is_named(
    model: LlamaModel, adapters: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        read_adapter_spec(tmp_path / "nowhere", model.cfg)
    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text((adapters["qv8"] / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE} not found"):
        read_adapter_spec(half, model.cfg)


def test_tensors_that_do_not_fit_the_model_are_named(
    model: LlamaModel, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapters["qv8"] / WEIGHTS_FILE))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = {
        "beyond": (
            {key.replace("layers.0", "layers.9"): tensors[key].clone()},
            "layer 9 >= num_layers 4",
        ),
        "missing": ({}, "lora_A.weight' is missing"),
        "lm_head": ({"base_model.model.lm_head.lora_A.weight": tensors[key]}, "unexpected"),
    }
    for name, (extra, named) in cases.items():
        folder = edited_copy(adapters["qv8"], tmp_path / name)
        edited = {k: v for k, v in tensors.items() if k != key} | extra
        if name == "beyond":
            edited[key] = tensors[key]
        save_file(edited, str(folder / WEIGHTS_FILE))
        with pytest.raises(ValueError, match=named):
            read_adapter_spec(folder, model.cfg)


# ---- serving: equal to peft ---------------------------------------------------------------


def test_prefill_and_decode_with_an_adapter_equal_peft(
    model: LlamaModel,
    peft_models: dict[str, Any],
    adapters: dict[str, Path],
    corpus: list[int],
    tiny_model_dir: Path,
) -> None:
    cache = make_cache(model)
    cache.register("all16", adapters["all16"])
    runner = lora_runner(model, tiny_model_dir, cache)
    slot = acquire_now(cache, "all16")
    tokens = prompt_tokens(corpus, 0, 40)
    blocks = scattered_blocks(1, 44, 64)
    got = [runner.execute(ScheduledBatch((chunk("a", tokens[:37], 0, blocks, slot),)))]
    for pos in range(37, 40):
        got.append(
            runner.execute(ScheduledBatch((chunk("a", tokens[pos : pos + 1], pos, blocks, slot),)))
        )
    want = reference(peft_models["all16"], tokens)[36:]
    torch.testing.assert_close(torch.cat(got), want, rtol=RTOL, atol=ATOL)
    base = reference(peft_models["base"], tokens)[36:]
    assert float((want - base).abs().max()) > 0.1  # the adapter does change the logits


def test_a_batch_of_three_adapters_and_base_rows_equals_each_reference(
    model: LlamaModel,
    peft_models: dict[str, Any],
    adapters: dict[str, Path],
    corpus: list[int],
    tiny_model_dir: Path,
) -> None:
    cache = make_cache(model, max_loras=3)
    for name, path in adapters.items():
        cache.register(name, path)
    runner = lora_runner(model, tiny_model_dir, cache)
    slots = {name: acquire_now(cache, name) for name in adapters} | {"base": -1}
    rows = ["qv8", "base", "mlp4", "all16", "qv8", "base"]  # a slot twice, not adjacent
    prompts = [prompt_tokens(corpus, 10 + i, 20 + 3 * i) for i in range(len(rows))]
    blocks = [tuple(range(8 * i, 8 * i + 8)) for i in range(len(rows))]
    prefill = tuple(
        chunk(f"r{i}", p, 0, blocks[i], slots[n])
        for i, (n, p) in enumerate(zip(rows, prompts, strict=True))
    )
    steps = [runner.execute(ScheduledBatch(prefill))]
    for _ in range(3):  # decodes of every row in one step, greedy
        for p, logits in zip(prompts, steps[-1], strict=True):
            p.append(int(logits.argmax()))
        decode = tuple(
            chunk(f"r{i}", p[-1:], len(p) - 1, blocks[i], slots[n])
            for i, (n, p) in enumerate(zip(rows, prompts, strict=True))
        )
        steps.append(runner.execute(ScheduledBatch(decode)))
    for i, (name, p) in enumerate(zip(rows, prompts, strict=True)):
        got = torch.stack([s[i] for s in steps])
        torch.testing.assert_close(got, reference(peft_models[name], p)[-4:], rtol=RTOL, atol=ATOL)


def test_greedy_tokens_equal_peft_generate(
    model: LlamaModel,
    peft_models: dict[str, Any],
    adapters: dict[str, Path],
    corpus: list[int],
    tiny_model_dir: Path,
) -> None:
    cache = make_cache(model)
    cache.register("mlp4", adapters["mlp4"])
    runner = lora_runner(model, tiny_model_dir, cache)
    slot = acquire_now(cache, "mlp4")
    tokens = prompt_tokens(corpus, 3, 24)  # a prompt whose 16 greedy tokens hold no eos
    blocks = scattered_blocks(2, 24 + 16, 64)
    logits = runner.execute(ScheduledBatch((chunk("g", tokens, 0, blocks, slot),)))
    for _ in range(16):
        tokens.append(int(logits[0].argmax()))
        pos = len(tokens) - 1
        logits = runner.execute(ScheduledBatch((chunk("g", tokens[-1:], pos, blocks, slot),)))
    with torch.inference_mode():
        want = (
            peft_models["mlp4"]
            .generate(
                input_ids=torch.tensor([tokens[:24]]),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
            )[0]
            .tolist()
        )
    assert tokens == want


def test_base_rows_of_a_lora_runner_equal_the_plain_runner(
    model: LlamaModel, corpus: list[int], tiny_model_dir: Path
) -> None:
    cache = make_cache(model)
    plain = ModelRunner(
        model, make_pool(model), EngineConfig(str(tiny_model_dir), block_size=16, cuda_graphs=False)
    )
    tokens = prompt_tokens(corpus, 7, 30)
    step = ScheduledBatch((chunk("b", tokens, 0, (0, 1), -1),))
    assert torch.equal(lora_runner(model, tiny_model_dir, cache).execute(step), plain.execute(step))
    with pytest.raises(ValueError, match="LoRA slot 0 out of range"):
        plain.execute(ScheduledBatch((chunk("b", tokens, 0, (0, 1), 0),)))


# ---- the graph kernels equal the grouped one ------------------------------------------------


class StrictSegmentGEMM:
    """flashinfer's SegmentGEMMWrapper as documented, checking what the kernel relies on."""

    def __init__(self, workspace: torch.Tensor) -> None:
        assert workspace.dtype == torch.int8

    def run(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        batch_size: int,
        weight_column_major: bool,
        seg_lens: torch.Tensor | None = None,
        seg_indptr: torch.Tensor | None = None,
        weight_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert seg_indptr is not None and weight_indices is not None
        assert x.is_contiguous() and weights.is_contiguous() and weights.dim() == 3
        assert seg_indptr.dtype == torch.int64 and seg_indptr.shape == (batch_size + 1,)
        assert weight_indices.dtype == torch.int64 and weight_indices.shape == (batch_size,)
        assert int(seg_indptr[-1]) == x.shape[0] and int(weight_indices.max()) < weights.shape[0]
        d_out = weights.shape[1] if weight_column_major else weights.shape[2]
        y = torch.zeros((x.shape[0], d_out), dtype=x.dtype)
        for i in range(batch_size):
            lo, hi = int(seg_indptr[i]), int(seg_indptr[i + 1])
            w = weights[int(weight_indices[i])]
            y[lo:hi] = x[lo:hi] @ (w.t() if weight_column_major else w)
        return y


@pytest.mark.parametrize("kernel", ["torch", "flashinfer", "torch after flashinfer"])
def test_graph_kernels_add_what_the_grouped_kernel_adds(
    model: LlamaModel, adapters: dict[str, Path], kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.lora.lora_apply as la
    from engine.lora.lora_adapter import load_adapter

    monkeypatch.setattr(la, "_segment_gemm_class", lambda: StrictSegmentGEMM)
    made = "flashinfer" if kernel.endswith("flashinfer") else kernel
    weights = LoraWeights(model.cfg, 3, 16, torch.float32, torch.device("cpu"), made)
    if kernel != made:
        weights.use_torch_kernel()  # dense over the segment kernel's rows, zero row included
    for slot, path in enumerate(adapters.values()):
        weights.fill(
            slot, load_adapter(read_adapter_spec(path, model.cfg), model.cfg, torch.float32)
        )
    token_slots = np.array([2, 2, -1, 0, 1, 1, -1, 0, 2, 1], dtype=np.int32)
    grouped = eager_step(weights, token_slots, torch.device("cpu"))
    graph = graph_step(weights, torch.from_numpy(token_slots))
    assert grouped is not None and grouped.projections == graph.projections
    gen = torch.Generator().manual_seed(0)
    for layer in (0, 3):
        for proj, parts in weights.parts.items():
            x = torch.randn(len(token_slots), parts.fan_in, generator=gen)
            base = torch.randn(len(token_slots), parts.columns[-1][1], generator=gen)
            want, got = base.clone(), base.clone()
            grouped.add(layer, proj, x, want)
            graph.add(layer, proj, x, got)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got[token_slots < 0], base[token_slots < 0])
    assert eager_step(weights, np.full(4, -1, dtype=np.int32), torch.device("cpu")) is None


class _GraphsFailingWithSegmentGEMM:
    """DecodeGraphs stand-in whose capture fails while the LoRA kernel is flashinfer's."""

    def __init__(self, *args: object) -> None:
        self.lora = cast(LoraWeights, args[-1])

    def capture(self) -> None:
        if self.lora.kernel == "flashinfer":
            raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("chosen", [True, False])
def test_a_failed_capture_with_the_segment_kernel_falls_back_to_torch_when_it_was_chosen(
    model: LlamaModel, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, chosen: bool
) -> None:
    import engine.core.runner as runner_module
    import engine.lora.lora_apply as la

    monkeypatch.setattr(la, "_segment_gemm_class", lambda: StrictSegmentGEMM)
    monkeypatch.setattr(runner_module, "DecodeGraphs", _GraphsFailingWithSegmentGEMM)
    weights = LoraWeights(model.cfg, 2, 8, torch.float32, model.device, "flashinfer", chosen)
    runner = ModelRunner(
        model,
        make_pool(model),
        EngineConfig(str(tiny_model_dir), cuda_graphs=False),
        lora_weights=weights,
    )
    if not chosen:
        with pytest.raises(RuntimeError, match="stream is capturing"):
            runner._capture_graphs(4, 8)
        return
    runner._capture_graphs(4, 8)
    assert weights.kernel == "torch" and weights.segment_gemm is None


def test_fp8_projections_with_an_adapter_stay_close_to_the_dense_ones(
    tiny_model_dir: Path, adapters: dict[str, Path], corpus: list[int]
) -> None:
    from engine.loading.fp8_calibration import calibrate_activations, observe
    from engine.modeling.llama import causal_attend

    dense = load_model(tiny_model_dir, torch.float32)
    fp8 = load_model(tiny_model_dir, torch.float32)
    fp8.quantize_fp8()
    calibrate_activations(fp8, observe(fp8, corpus[:64]))  # static scales: the bypassed path
    ids = prompt_tokens(corpus, 3, 32)
    cache = make_cache(dense)
    cache.register("all16", adapters["all16"])
    slots = np.full(32, acquire_now(cache, "all16"), dtype=np.int32)

    def logits(m: LlamaModel, lora: bool) -> torch.Tensor:
        step = eager_step(cache.weights, slots, m.device) if lora else None
        attend = causal_attend(1, 32, m.cfg.num_heads, m.cfg.num_kv_heads)
        with torch.inference_mode():
            return m.compute_logits(m(torch.tensor(ids), torch.arange(32), attend, lora=step))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    adapted, adapted8 = logits(dense, True), logits(fp8, True)
    delta, delta8 = adapted - logits(dense, False), adapted8 - logits(fp8, False)
    # e4m3 weights and activations, static scales calibrated on the base model's activations
    # (the adapter moves them): a few percent, and the adapter's effect is kept
    assert rel(adapted8, adapted) < 0.1 and rel(delta8, delta) < 0.1
    assert float(delta.norm()) > 0.5 * float(adapted.norm())
    layer = cast(DecoderLayer, fp8.layers[0])
    step = eager_step(cache.weights, slots, fp8.device)
    assert layer._static_scale("down_proj") is not None  # the fused e4m3 input without LoRA
    assert layer._static_scale("down_proj", step) is None  # the adapter reads it unquantized


def write_random_adapter(out: Path, cfg: ModelConfig, rank: int, modules: list[str]) -> Path:
    """A PEFT-layout adapter with random weights for a model peft has no checkpoint of."""
    from safetensors.torch import save_file

    from engine.lora.lora_adapter import module_shape, tensor_name

    gen = torch.Generator().manual_seed(rank)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            fan_in, fan_out = module_shape(cfg, m)
            tensors[tensor_name(layer, m, "A")] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[tensor_name(layer, m, "B")] = torch.randn(fan_out, rank, generator=gen) * 0.1
    out.mkdir()
    save_file(tensors, str(out / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": modules}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["torch", "triton", "flashinfer"])
def test_graph_decode_with_adapters_equals_eager(tmp_path: Path, kernel: str) -> None:
    """head_dim 64 (flashinfer attention, CUDA graphs), random weights and adapters."""
    from deploy.checkpoints.make_model import PRESETS, hf_config
    from engine.loading.dummy_weights import dummy_model
    from engine.lora.lora_apply import lora_kernel_unavailable_reason

    device = torch.device("cuda", torch.cuda.current_device())
    reason = lora_kernel_unavailable_reason(kernel, device, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    cfg = ModelConfig.from_dict(hf_config(PRESETS["tiny"].with_options(hidden_size=256), 0, 1))
    model = dummy_model(cfg, torch.bfloat16, device).eval()
    cache = LoraCache(cfg, LoraCacheConfig(max_loras=3, kernel=kernel), model.dtype, device)
    for i, (rank, modules) in enumerate([(8, ATTENTION), (16, MLP), (4, ATTENTION + MLP)]):
        cache.register(f"a{i}", write_random_adapter(tmp_path / f"a{i}", cfg, rank, modules))
    slots = [acquire_now(cache, f"a{i}") for i in range(3)]
    config = EngineConfig(
        "random",
        block_size=16,
        attention_backend="flashinfer",
        cuda_graph_max_batch=8,
        max_num_seqs=8,
        max_model_len=256,
    )
    graphs = ModelRunner(model, make_pool(model), config, lora_weights=cache.weights)
    eager_config = replace(config, cuda_graphs=False)
    eager = ModelRunner(model, make_pool(model), eager_config, lora_weights=cache.weights)
    rows = [slots[0], -1, slots[1], slots[2], slots[0]]
    step = ScheduledBatch(tuple(chunk(f"r{i}", [i + 3], 0, (i,), s) for i, s in enumerate(rows)))
    assert graphs.graphs is not None
    replays = graphs.graphs.num_replays
    got = graphs.execute(step)
    assert graphs.graphs.num_replays == replays + 1
    want = eager.execute(step)  # grouped kernel; bf16 rounding differs from the graph's
    assert float((got - want).norm() / want.norm()) < 2e-2
    base = eager.execute(ScheduledBatch(tuple(replace(c, lora_slot=-1) for c in step.chunks)))
    assert float((want - base).norm() / base.norm()) > 5e-2  # the adapters do matter


# ---- a worker's reader gets the engine's own abort as the request's error --------------------


def test_a_worker_stream_raises_the_adapter_error_when_the_engine_ends_the_request(
    tiny_model_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The adapter's read fails after registration: the engine ends the request (ABORT with
    a LoraLoadError), and the worker hands that error to the request's reader (which raises
    it to the router: FAILED_PRECONDITION naming the adapter), not an output without tokens.
    A request on the base model beside it is served."""
    from vocabulary.worker_api import WorkerRole
    from worker_runtime.runtime import WorkerConfig, WorkerRuntime, next_output

    folder = tmp_path / "gone"
    shutil.copytree(next(iter(adapters.values())), folder)
    engine = EngineConfig(
        str(tiny_model_dir), device="cpu", num_kv_blocks=64, cuda_graphs=False,
        loras=(("gone", str(folder)),),
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def serve() -> None:
        rt = WorkerRuntime(WorkerConfig("w0", WorkerRole.PREFILL, engine), "w0")
        await rt.start()
        try:
            (folder / WEIGHTS_FILE).unlink()  # after the check at registration
            lost, base = rt.open_stream("lost"), rt.open_stream("base")
            await rt.call(lambda e: e.add_request("lost", [5, 6, 7], greedy, lora_name="gone"))
            await rt.call(lambda e: e.add_request("base", [5, 6, 7], greedy))
            with pytest.raises(LoraLoadError, match="'gone'"):
                await next_output(lost, time.time() + 30, "lost")
            out = await next_output(base, time.time() + 30, "base")
            assert out.new_token_ids
        finally:
            rt.stop()

    asyncio.run(serve())
