"""Static FP8 scales calibrated at load: one forward pass over a fixed text.

Quantizing an activation with a scale known before the step lets the op that produces it
(RMSNorm, SiLU·mul, attention's output) write e4m3 directly, instead of a reduction for the
amax plus a separate cast kernel in front of every FP8 GEMM (engine/quantization/fp8_linear.py). The
scales come from the checkpoint when it has them (`input_scale`, compressed-tensors), else from
here:

    observe(model, ids)     one causal forward of `ids` (torch ops, no KV cache) recording
                            the amax of every FP8 projection's input and of every layer's K
                            (after RoPE) and V
    activation scale        pow2(amax * ACTIVATION_HEADROOM / 448) per projection
    KV scale                pow2(amax * KV_HEADROOM / 448) per layer, K and V apart

Power-of-two scales divide exactly in any float format, so two workers with the same weights
calibrate to the same bits (the KV scales are part of the transfer handshake: a prefill and
a decode worker must agree on them). e4m3's precision is relative (3 mantissa bits from 2^-6
to 448), so headroom above the observed amax costs only values 2^-15 below it, while an
activation beyond the scale's range saturates: the headroom guards against prompts whose
activations run hotter than the calibration text's.

Tensor parallelism: each rank observes its part (its heads, its intermediate rows) and the
ranks agree on the max of every amax (`agree_max`), so every rank gets the scales a whole
model would (the amax over all heads is the max over the parts) and all ranks' KV pools have
the same scales, as the transfer handshake needs.

Pipeline parallelism: the calibration pass runs through the stages as a step does
(`StageRelay`: stage 0 embeds the text and hands its layers' (h, residual) on, each later
stage runs its layers over what the stage before handed it), so each stage observes its
layers on exactly the inputs a whole model's pass gives them, and calibrates the scales of
its own projections and layers: those of a whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS
from engine.modeling.llama import Attend, LlamaModel, causal_attend
from engine.quantization.fp8_linear import Fp8Linear, pow2_scale

ACTIVATION_HEADROOM = 4.0
KV_HEADROOM = 2.0

CALIBRATION_TEXT = (
    "The history of the city begins with a small settlement by the river, where traders "
    "met to exchange grain, salt and cloth. Over the centuries it grew into a busy port. "
    "Question: what is 17 times 23? Answer: 17 times 23 is 391. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n"
    "In the morning the weather was cold and grey, but by noon the sun had come out and "
    'the children ran to the park. She said: "Please send me the report by Friday." '
    "Les enfants jouent dans le jardin. Die Katze schläft auf dem Sofa. 東京は日本の首都です。 "
    '1, 2, 3, 5, 8, 13, 21, 34, 55, 89; {"name": "Ada", "age": 36, "tags": ["x"]}. '
)
"""Mixed prose, code, numbers and scripts: activations of the kinds serving sees."""


@dataclass(frozen=True)
class Observed:
    """Amax values of one calibration pass."""

    activations: dict[str, float]
    """Per FP8 projection without a static input scale (its module path in the model): amax
    of its input."""
    kv: tuple[tuple[float, float], ...]
    """Per layer: (amax of K after RoPE, amax of V)."""


class StageRelay(Protocol):
    """A pipeline stage's links to its neighbours (engine/pp/pipeline_group.py `PPGroup`)."""

    def receive_activations(
        self, num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """The stage before's (h, residual) stacked [2, tokens, hidden]; None on stage 0."""
        ...

    def send_activations(self, pair: torch.Tensor) -> None:
        """Hand this stage's (h, residual) to the next stage (nothing on the last)."""
        ...


@torch.inference_mode()
def observe(
    model: LlamaModel, token_ids: Sequence[int], relay: StageRelay | None = None
) -> Observed:
    """One causal forward of `token_ids` (a single sequence from position 0), recording the
    amax of each dynamic FP8 projection's input and each layer's K and V; `relay`: a
    pipeline stage's model, its part of the pass (module docstring)."""
    cfg, device = model.cfg, model.device
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    acts: dict[str, float] = {}
    kv = [(0.0, 0.0)] * cfg.num_layers

    def record(name: str) -> object:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            acts[name] = max(acts.get(name, 0.0), _amax(args[0]))

        return hook

    handles = [
        m.register_forward_pre_hook(record(name))  # type: ignore[arg-type]
        for name, m in model.named_modules()
        if isinstance(m, Fp8Linear) and m.input_scale is None  # a static one gets e4m3 in
    ]
    inner = causal_attend(1, len(token_ids), cfg.num_heads, cfg.num_kv_heads)

    def attend(
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv[layer] = (_amax(k), _amax(v))
        return inner(layer, q, k, v, out_scale)

    typed: Attend = attend
    try:
        if relay is None:
            model(ids, positions, typed)
        else:
            carried = relay.receive_activations(len(ids), cfg.hidden_size, model.dtype, device)
            h, residual = (model.embed(ids), None) if carried is None else carried.unbind()
            h, residual = model.run_layers(h, residual, positions, typed)
            assert residual is not None  # a stage holds at least one layer
            relay.send_activations(torch.stack((h, residual)))
    finally:
        for handle in handles:
            handle.remove()
    return Observed(activations=acts, kv=tuple(kv))


def agreed(observed: Observed, agree_max: Callable[[list[float]], list[float]]) -> Observed:
    """`observed` with every amax replaced by `agree_max`'s (the max over the TP ranks; every
    rank observes the same projections, so the sorted names line up)."""
    names = sorted(observed.activations)
    flat = [observed.activations[n] for n in names] + [a for pair in observed.kv for a in pair]
    out = agree_max(flat)
    acts = dict(zip(names, out[: len(names)], strict=True))
    rest = out[len(names) :]
    kv = tuple((rest[2 * i], rest[2 * i + 1]) for i in range(len(observed.kv)))
    return Observed(activations=acts, kv=kv)


def _amax(t: torch.Tensor) -> float:
    return float(t.detach().abs().amax().float())


def calibrate_activations(model: LlamaModel, observed: Observed, everyone: bool = False) -> int:
    """Give every FP8 projection without an `input_scale` (from its checkpoint) and without
    dynamic activations its checkpoint declares (`Fp8Linear.dynamic`; `everyone`: those too,
    EngineConfig.fp8_activation_scales "calibrated") a static one from `observed`; returns
    how many were set."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) and m.input_scale is None and (everyone or not m.dynamic):
            scale = pow2_scale(observed.activations[name], ACTIVATION_HEADROOM)
            m.input_scale = torch.tensor(scale, dtype=torch.float32, device=m.weight.device)
            n += 1
    return n


def kv_scales(observed: Observed) -> tuple[float, ...]:
    """Flat per-layer KV scales (k0, v0, k1, v1, ...) for an e4m3 pool."""
    return tuple(pow2_scale(amax, KV_HEADROOM) for pair in observed.kv for amax in pair)


def prepare_fp8(
    model: LlamaModel,
    encode: Callable[[str], list[int]],
    quantization: str,
    kv_cache_dtype: str,
    max_tokens: int,
    agree_max: Callable[[list[float]], list[float]] | None = None,
    activation_scales: str = "checkpoint",
    relay: StageRelay | None = None,
) -> tuple[float, ...]:
    """Make a loaded model serve as configured (EngineConfig.quantization, kv_cache_dtype):
    quantize its projections (unless the checkpoint already was FP8), calibrate static input
    scales on the calibration text (tokenized with `encode`, at most `max_tokens`; only when
    something needs calibrating), and return the KV scales of an e4m3 pool (empty for a
    float pool; a pipeline stage's: its layers'). `agree_max`: a TP rank's element-wise max
    over the ranks (module docstring). `activation_scales`: EngineConfig.fp8_activation_scales.
    `relay`: a pipeline stage's links (`observe`). Raises ValueError naming a bad setting."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        choices = ", ".join(KV_CACHE_DTYPES)
        raise ValueError(f"kv_cache_dtype: one of {choices}, got {kv_cache_dtype!r}")
    if quantization == "fp8" and model.quantization == "none":  # an INT checkpoint stays INT
        model.quantize_fp8()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()  # the KV pool is sized after this: it gets the memory
    if model.quantization != "fp8" and kv_cache_dtype != "fp8":
        return ()
    observed = observe(model, calibration_ids(encode, model.cfg.vocab_size, max_tokens), relay)
    if agree_max is not None:
        observed = agreed(observed, agree_max)
    if model.quantization == "fp8":
        calibrate_activations(model, observed, everyone=activation_scales == "calibrated")
    return kv_scales(observed) if kv_cache_dtype == "fp8" else ()


def calibration_ids(encode: Callable[[str], list[int]], vocab_size: int, limit: int) -> list[int]:
    """The calibration text as token ids of this model (at most `limit`)."""
    ids = [t for t in encode(CALIBRATION_TEXT) if 0 <= t < vocab_size][:limit]
    if not ids:
        raise ValueError("the calibration text encodes to no token of this model")
    return ids
