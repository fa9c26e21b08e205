"""The triton LoRA graph kernel (engine/lora/lora_triton.py) adds what the grouped kernel adds.

CPU: Triton's interpreter runs the kernels on CPU tensors. Whether a kernel is interpreted is
fixed when it is defined (`triton.jit` reads TRITON_INTERPRET), and this pytest process may
hold the compiled ones (the GPU tests), so interpreted launches run in a subprocess
(`interpret`): a test builds the inputs and the reference here, the subprocess only runs the
kernel (through a `LoraStep` of real `LoraWeights`, or `add_lora` with small tiles). Mixed
slots with base tokens, one slot for every token, an all-base batch, ranks 4 to 64 in slots
padded to 16, 48 (masked to a 64-wide tile) and 64, parts whose widths are no multiple of the
tiles, fan-ins split over many programs; each with both shrinks (dense over the slots, BGMV);
a slot no token reads holds NaN throughout (an upload in flight: what the kernel adds must
not depend on it; the dense shrink reads it, the expand never does).

GPU: compiled, in bf16 at the Llama-3 8B and 70B shapes (one layer), inside a CUDA graph
replayed after its slot tensor changes in place, and the self-check (test_lora's
test_graph_decode_with_adapters_equals_eager runs a ModelRunner decode graph with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
import triton_interpret

pytest.importorskip(
    "triton", reason="the triton LoRA kernel needs triton (pdserve[test])", exc_type=ImportError
)

from runner_factories import make_pool
from test_lora import ATTENTION, MLP

import engine.lora.lora_apply as la
from engine.config import EngineConfig
from engine.core.runner import ModelRunner
from engine.lora.lora_adapter import LORA_MODULES, LoraAdapter, LoraSpec, module_shape
from engine.lora.lora_apply import LoraWeights, eager_step, graph_step
from engine.lora.lora_triton import (
    DEFAULT_SHRINK,
    MAX_K_STEPS,
    SHRINKS,
    Tiles,
    add_lora,
    fan_in_split,
)
from vocabulary.model_config import ModelConfig

CPU = torch.device("cpu")
ALL = ATTENTION + MLP
MIXED = [2, 2, -1, 0, 1, 1, -1, 3, 0, 2, 1, 3]  # slots twice and not adjacent, base rows


def shape_config(preset: str, num_layers: int | None = None) -> ModelConfig:
    from deploy.checkpoints.make_model import PRESETS, hf_config

    shape = PRESETS[preset]
    if num_layers is not None:
        shape = shape.with_options(num_layers=num_layers)
    return ModelConfig.from_dict(hf_config(shape, 0, 1))


def random_adapter(
    cfg: ModelConfig, rank: int, modules: list[str], seed: int, dtype: torch.dtype, device: str
) -> LoraAdapter:
    """An adapter with random weights in memory (A ~ fan_in^-1/2, B ~ rank^-1/2)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a, b = {}, {}
    for m in modules:
        fan_in, fan_out = module_shape(cfg, m)
        shape_a, shape_b = (cfg.num_layers, rank, fan_in), (cfg.num_layers, rank, fan_out)
        a[m] = (torch.randn(shape_a, generator=gen, device=device) * fan_in**-0.5).to(dtype)
        b[m] = (torch.randn(shape_b, generator=gen, device=device) * rank**-0.5).to(dtype)
    ordered = tuple(m for m in LORA_MODULES if m in modules)
    layers = (tuple(range(cfg.num_layers)),) * len(ordered)
    return LoraAdapter(LoraSpec(Path(f"random-{seed}"), rank, 1.0, ordered, layers), a, b)


def poison(weights: LoraWeights, slot: int) -> None:
    """NaN in every weight of `slot` (what no token reading another slot may see)."""
    for proj, a in weights.a.items():
        a[:, :, slot] = float("nan")
        for b in weights.b[proj]:
            b[:, slot] = float("nan")


def filled_weights(cfg: ModelConfig, max_rank: int, dtype: torch.dtype, device: str) -> LoraWeights:
    """Five slots: ranks 8 (q, v), 4 (MLP), 16 (all), `max_rank` (all); slot 4 NaN."""
    weights = LoraWeights(cfg, 5, max_rank, dtype, torch.device(device), "triton")
    kinds = [(8, ["q_proj", "v_proj"]), (4, MLP), (16, ALL), (max_rank, ALL)]
    for slot, (rank, modules) in enumerate(kinds):
        weights.fill(slot, random_adapter(cfg, rank, modules, slot, dtype, device))
    poison(weights, 4)
    return weights


# ---- CPU: Triton's interpreter, in a subprocess ---------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One add for the interpreter: `graph_step(weights, slots).add(layer, proj, x, out)`, or
    without weights `add_lora(x, out, slots, a, b, columns, tiles)`."""

    x: torch.Tensor
    out: torch.Tensor
    slots: torch.Tensor
    weights: LoraWeights | None = None
    layer: int = 0
    proj: str = ""
    a: torch.Tensor | None = None
    b: tuple[torch.Tensor, ...] = ()
    columns: tuple[tuple[int, int], ...] = ()
    tiles: Tiles | None = None
    shrink: str = DEFAULT_SHRINK
    """The shrink `add_lora` runs (through a `LoraStep`: its default, set for the launch)."""


def run_interpreted(inputs: str, outputs: str) -> None:
    """The subprocess's side of `interpret`."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import engine.lora.lora_triton as lora_triton

    launches: list[Launch] = torch.load(inputs, weights_only=False)
    for launch in launches:
        lora_triton.DEFAULT_SHRINK = launch.shrink
        if launch.weights is not None:
            step = graph_step(launch.weights, launch.slots)
            step.add(launch.layer, launch.proj, launch.x, launch.out)
        else:
            assert launch.a is not None
            args = (launch.a, launch.b, launch.columns, launch.tiles, launch.shrink)
            add_lora(launch.x, launch.out, launch.slots, *args)
    torch.save([launch.out for launch in launches], outputs)


def interpret(launches: list[Launch], tmp_path: Path) -> list[torch.Tensor]:
    """Each launch's `out` after its add, run by Triton's interpreter in a subprocess."""
    return cast(list[torch.Tensor], triton_interpret.interpret(__file__, launches, tmp_path))


OWN_SLOT_SHRINKS = ("dense", "bgmv")
"""The shrinks whose expand reads only each token's own slot (a NaN slot no token reads stays
unseen); the "dot" expand multiplies every slot's B by zeros, so, like the dense torch kernel,
it needs every slot finite (as LoraWeights guarantees)."""


def check_against_grouped(
    weights: LoraWeights,
    token_slots: list[int],
    tmp_path: Path,
    layers: tuple[int, ...] = (0, 3),
    shrinks: tuple[str, ...] = OWN_SLOT_SHRINKS,
) -> None:
    """Every projection of `layers`, with each of `shrinks`: the interpreted kernel adds what
    the grouped one adds, and leaves base rows bit-identical."""
    slots = np.array(token_slots, dtype=np.int32)
    gen = torch.Generator().manual_seed(len(token_slots))
    launches, wants = [], []
    grouped = eager_step(weights, slots, CPU)
    for layer in layers:
        for proj, parts in weights.parts.items():
            x = torch.randn(len(slots), parts.fan_in, generator=gen)
            base = torch.randn(len(slots), parts.columns[-1][1], generator=gen)
            want = base.clone()
            if grouped is not None:
                grouped.add(layer, proj, x, want)
            for shrink in shrinks:
                wants.append((want, base))
                launches.append(
                    Launch(
                        x, base.clone(), torch.from_numpy(slots), weights, layer, proj,
                        shrink=shrink,
                    )
                )  # fmt: skip
    for got, (want, base) in zip(interpret(launches, tmp_path), wants, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[slots < 0], base[slots < 0])


@pytest.mark.parametrize("max_rank", [16, 48, 64])
def test_interpreted_kernel_adds_what_the_grouped_kernel_adds(
    max_rank: int, tmp_path: Path
) -> None:
    weights = filled_weights(shape_config("tiny"), max_rank, torch.float32, "cpu")
    assert weights.rank == max_rank and weights.a["o_proj"].shape[2] == 5  # no zero row
    check_against_grouped(weights, MIXED, tmp_path)


@pytest.mark.parametrize("max_rank", [16, 64])
def test_interpreted_dot_expand_adds_what_the_grouped_kernel_adds(
    max_rank: int, tmp_path: Path
) -> None:
    weights = filled_weights(shape_config("tiny"), max_rank, torch.float32, "cpu")
    weights.clear(4)  # finite everywhere, as the dot expand requires
    check_against_grouped(weights, MIXED, tmp_path, shrinks=("dot",))
    check_against_grouped(weights, [-1] * 5, tmp_path, layers=(2,), shrinks=("dot",))


def test_interpreted_kernel_with_every_token_on_one_slot(tmp_path: Path) -> None:
    weights = filled_weights(shape_config("tiny"), 16, torch.float32, "cpu")
    check_against_grouped(weights, [2] * 6, tmp_path, layers=(1,))


def test_interpreted_kernel_leaves_an_all_base_batch_alone(tmp_path: Path) -> None:
    weights = filled_weights(shape_config("tiny"), 16, torch.float32, "cpu")
    for slot in range(weights.num_slots):
        poison(weights, slot)
    check_against_grouped(weights, [-1] * 5, tmp_path, layers=(2,))


def bgmv_reference(
    x: torch.Tensor,
    out: torch.Tensor,
    slots: list[int],
    a: torch.Tensor,
    b: tuple[torch.Tensor, ...],
    columns: tuple[tuple[int, int], ...],
) -> torch.Tensor:
    want = out.double()
    for t, s in enumerate(slots):
        for p, (lo, hi) in enumerate(columns):
            if s >= 0:
                want[t, lo:hi] += (a[p, s].double() @ x[t].double()) @ b[p][s].double()
    return want


@pytest.mark.parametrize("shrink", SHRINKS)
@pytest.mark.parametrize(
    ("widths", "fan_in", "rank", "tiles", "dtype"),
    [
        ((100, 36, 36), 200, 24, Tiles(32, 64, 32, split_k=3), torch.float32),
        ((100, 36, 36), 200, 24, Tiles(32, 64, 32, split_k=3), torch.bfloat16),
        ((50, 70), 1000, 16, Tiles(16, 64, 16, split_k=100), torch.float32),
        ((7,), 8500, 16, None, torch.float32),  # default tiles: 17 splits of one step
        ((7,), 8500, 16, Tiles(16, 512, 256, split_k=1), torch.float16),  # 3 splits of 8
    ],
)
def test_interpreted_kernel_tiles_parts_of_any_width_and_split_fan_ins(
    widths: tuple[int, ...],
    fan_in: int,
    rank: int,
    tiles: Tiles | None,
    dtype: torch.dtype,
    shrink: str,
    tmp_path: Path,
) -> None:
    if shrink == "dot" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter has no bf16 dot (the GPU tests run it)")
    gen = torch.Generator().manual_seed(fan_in)
    rows, slots = 4, [3, -1, 0, 0, 2, -1, 3, 1, 2]
    columns = tuple((sum(widths[:i]), sum(widths[: i + 1])) for i in range(len(widths)))
    a = (torch.randn(len(widths), rows, rank, fan_in, generator=gen) * fan_in**-0.5).to(dtype)
    b = tuple(torch.randn(rows, rank, w, generator=gen).to(dtype) for w in widths)
    wide = torch.randn(len(slots), fan_in + 3, generator=gen).to(dtype)
    x = wide[:, 1 : fan_in + 1]  # rows strided wider than the fan-in
    base = torch.randn(len(slots), sum(widths) + 5, generator=gen).to(dtype)  # and spare columns
    slot_tensor = torch.tensor(slots, dtype=torch.int64)
    launch = Launch(
        x, base.clone(), slot_tensor, a=a, b=b, columns=columns, tiles=tiles, shrink=shrink
    )
    (got,) = interpret([launch], tmp_path)
    want = bgmv_reference(x, base, slots, a, b, columns)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # one rounding into fp16/bf16
        err = float((got.double() - want).norm() / want.norm())
        assert err < (2e-3 if dtype == torch.float16 else 1e-2)
    is_base = torch.tensor(slots) < 0
    assert torch.equal(got[is_base], base[is_base]) and torch.equal(got[:, -5:], base[:, -5:])


# ---- CPU: the launch shapes and the choice of kernel ----------------------------------------


def test_fan_in_splits_cover_the_fan_in_with_no_empty_split() -> None:
    for tokens in (1, 7, 64, 512):
        for parts in (1, 2, 3):
            for fan_in in (128, 384, 4096, 8192, 8500, 14336, 28672):
                for tiles in (Tiles(16, 512, 256), Tiles(64, 128, 64), Tiles(16, 64, 16, 5)):
                    split = fan_in_split(tokens, parts, fan_in, tiles)
                    span = split.k_steps * tiles.block_k
                    assert split.k_steps in (1, 2, 4, 8) and split.k_steps <= MAX_K_STEPS
                    assert (split.splits - 1) * span < fan_in <= split.splits * span
    # Llama-3-8B at B=64, rank 16: qkv, o, gate_up, down
    tiles = Tiles(16, 512, 256)
    got = [fan_in_split(64, p, k, tiles) for p, k in ((3, 4096), (1, 4096), (2, 4096), (1, 14336))]
    assert [(s.k_steps, s.splits) for s in got] == [(2, 4), (1, 8), (1, 8), (2, 14)]


def test_the_triton_kernel_runs_on_cuda_or_in_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = la.lora_kernel_unavailable_reason("triton", CPU, torch.bfloat16)
    assert reason is not None and "runs on CUDA (or with TRITON_INTERPRET=1)" in reason
    with pytest.raises(ValueError, match="runs on CUDA"):
        la.select_lora_kernel("triton", CPU, torch.bfloat16)
    reason = la.lora_kernel_unavailable_reason("triton", CPU, torch.int8)
    assert reason is not None and "fp16/bf16/fp32" in reason
    assert la.select_lora_kernel("auto", CPU, torch.bfloat16) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert la.lora_kernel_unavailable_reason("triton", CPU, torch.float32) is None


def test_the_self_check_measures_a_graph_kernel_against_fp32() -> None:
    assert la.check_graph_kernel("torch", CPU, torch.float32) < 1e-5
    assert 1e-4 < la.check_graph_kernel("torch", CPU, torch.bfloat16) < la.SELF_CHECK_TOLERANCE


def test_auto_takes_torch_off_cuda_and_in_float32() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert la.select_lora_kernel("auto", CPU, dtype) == "torch"
    assert la.select_lora_kernel("auto", torch.device("cuda", 0), torch.float32) == "torch"


@pytest.mark.gpu
def test_auto_picks_the_dot_kernel_on_this_gpu() -> None:
    from engine.lora import lora_triton

    device = torch.device("cuda", torch.cuda.current_device())
    assert lora_triton.DEFAULT_SHRINK == "dot"
    assert la.select_lora_kernel("auto", device, torch.bfloat16) == "triton"


class _GraphsFailingWithTriton:
    """DecodeGraphs stand-in whose capture fails while the LoRA kernel is triton's."""

    def __init__(self, *args: object) -> None:
        self.lora = cast(LoraWeights, args[-1])

    def capture(self) -> None:
        if self.lora.kernel == "triton":
            raise RuntimeError("triton: out of resources")


def test_a_failed_capture_with_the_chosen_triton_kernel_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine.core.runner as runner_module
    from engine.loading.dummy_weights import dummy_model

    monkeypatch.setattr(runner_module, "DecodeGraphs", _GraphsFailingWithTriton)
    cfg = shape_config("tiny")
    model = dummy_model(cfg, torch.float32, "cpu").eval()
    weights = LoraWeights(cfg, 2, 8, torch.float32, CPU, "triton", may_fall_back=True)
    config = EngineConfig("random", block_size=16, cuda_graphs=False)
    runner = ModelRunner(model, make_pool(model), config, lora_weights=weights)
    runner._capture_graphs(4, 8)
    assert weights.kernel == "torch" and not weights.may_fall_back


# ---- GPU: compiled ----------------------------------------------------------------------------


def cuda_weights(preset: str, max_rank: int, num_slots: int = 16) -> LoraWeights:
    """One layer of `preset`, bf16 on the GPU, every slot filled (ranks and targets vary)."""
    cfg = shape_config(preset, num_layers=1)
    weights = LoraWeights(cfg, num_slots, max_rank, torch.bfloat16, torch.device("cuda"), "triton")
    kinds = [(max_rank, ALL), (8, ["q_proj", "v_proj"]), (4, MLP), (16, ATTENTION)]
    for slot in range(num_slots):
        rank, modules = kinds[slot % len(kinds)]
        weights.fill(slot, random_adapter(cfg, rank, modules, slot, torch.bfloat16, "cuda"))
    return weights


def assert_adds_like_grouped(
    got: torch.Tensor,
    x: torch.Tensor,
    base: torch.Tensor,
    weights: LoraWeights,
    slots: np.ndarray,
    proj: str,
) -> None:
    """`got` = base + the grouped kernel's delta of (layer 0, proj, x), within bf16 rounding;
    exactly base where the grouped kernel adds nothing (base rows, untargeted modules)."""
    want = base.clone()
    grouped = eager_step(weights, slots, base.device)
    if grouped is not None:
        grouped.add(0, proj, x, want)
    want_delta = want.float() - base.float()
    if float(want_delta.norm()) == 0.0:
        assert torch.equal(got, base), proj
        return
    err = (got.float() - base.float() - want_delta).norm() / want_delta.norm()
    assert float(err) < 2e-2, proj
    is_base = torch.from_numpy(slots < 0).to(got.device)
    assert torch.equal(got[is_base], base[is_base]), proj


def cuda_inputs(weights: LoraWeights, tokens: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """proj → (x, base output), random bf16 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    out = {}
    for proj, parts in weights.parts.items():
        x = torch.randn(tokens, parts.fan_in, generator=gen, device="cuda").bfloat16()
        base = torch.randn(tokens, parts.columns[-1][1], generator=gen, device="cuda").bfloat16()
        out[proj] = (x, base)
    return out


def mixed_slots(tokens: int, num_slots: int) -> np.ndarray:
    return np.array([(7 * i) % (num_slots + 1) - 1 for i in range(tokens)], dtype=np.int32)


@pytest.fixture(params=SHRINKS)
def each_shrink(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs once with each shrink as `add_lora`'s default."""
    import engine.lora.lora_triton as lora_triton

    monkeypatch.setattr(lora_triton, "DEFAULT_SHRINK", request.param)
    return cast(str, request.param)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("preset", "max_rank"), [("llama3-8b", 16), ("llama3-8b", 64), ("llama3-70b", 16)]
)
def test_triton_kernel_adds_what_the_grouped_kernel_adds_in_bf16(
    preset: str, max_rank: int, each_shrink: str
) -> None:
    weights = cuda_weights(preset, max_rank)
    slots = mixed_slots(64, weights.num_slots)
    step = graph_step(weights, torch.from_numpy(slots).cuda())
    for proj, (x, base) in cuda_inputs(weights, len(slots)).items():
        begun = step.begin(0, proj, x)  # the dot shrink: on the side stream, as the model runs it
        got = base.clone()
        step.add(0, proj, x, got, begun)
        assert_adds_like_grouped(got, x, base, weights, slots, proj)


@pytest.mark.gpu
def test_triton_kernel_in_a_cuda_graph_follows_slots_changed_in_place(each_shrink: str) -> None:
    weights = cuda_weights("llama3-8b", 16)
    tokens = 64
    inputs = cuda_inputs(weights, tokens)
    slots = torch.full((tokens,), -1, dtype=torch.int32, device="cuda")
    outs = {proj: base.clone() for proj, (_, base) in inputs.items()}

    def body() -> None:
        step = graph_step(weights, slots)
        for proj, (x, base) in inputs.items():
            begun = step.begin(0, proj, x)  # a parallel branch of the graph (dot shrink)
            outs[proj].copy_(base)  # the base projection's place
            step.add(0, proj, x, outs[proj], begun)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    patterns = [
        mixed_slots(tokens, weights.num_slots),
        np.full(tokens, -1, dtype=np.int32),
        np.full(tokens, 5, dtype=np.int32),
        mixed_slots(tokens, weights.num_slots)[::-1].copy(),
    ]
    for pattern in patterns:
        slots.copy_(torch.from_numpy(pattern))
        graph.replay()
        for proj, (x, base) in inputs.items():
            assert_adds_like_grouped(outs[proj], x, base, weights, pattern, proj)


@pytest.mark.gpu
def test_the_dot_shrink_overlaps_on_a_side_stream_only_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine.lora.lora_triton as lora_triton

    monkeypatch.setattr(lora_triton, "DEFAULT_SHRINK", "dot")
    weights = cuda_weights("llama3-8b", 16)
    slots = torch.from_numpy(mixed_slots(16, weights.num_slots)).cuda()
    (x, base) = cuda_inputs(weights, 16)["qkv_proj"]
    overlapped = graph_step(weights, slots)
    begun = overlapped.begin(0, "qkv_proj", x)
    assert begun is not None
    got = base.clone()
    overlapped.add(0, "qkv_proj", x, got, begun)
    monkeypatch.setattr(la, "OVERLAP_SHRINK", False)
    serial = graph_step(weights, slots)
    assert serial.begin(0, "qkv_proj", x) is None
    want = base.clone()
    serial.add(0, "qkv_proj", x, want)
    assert torch.equal(got, want)  # the same two kernels, on two streams


@pytest.mark.gpu
def test_the_triton_kernel_passes_its_self_check_on_this_gpu() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    assert la.check_graph_kernel("triton", device, torch.bfloat16) < la.SELF_CHECK_TOLERANCE
    assert la.select_lora_kernel("triton", device, torch.bfloat16) == "triton"
