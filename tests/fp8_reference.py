"""TEST-ONLY: the references quantized-checkpoint accuracy tests share (CPU and GPU): FP8,
and INT8 / INT4 against transformers + compressed-tensors.

Margin rule (issue 17): along the reference's greedy continuation (teacher-forced), let err_t
be the largest absolute difference between the FP8 and reference logits at step t, the FP8
side computed with the quantized weights, activations and KV values the engine uses. The
FP8 continuation must equal the reference up to its first differing token, and there the
reference's top-2 margin must be below 2 * err_t (at most, for bf16's coarse logits): a token
may flip only where quantization moved the logits by more than half the gap between the two
best tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.engine import LLMEngine
from engine.modeling.llama import LlamaModel, causal_attend
from engine.quantization.fp8_linear import quantize_static
from vocabulary.sampling import SamplingParams


def teacher_forced_logits(
    model: LlamaModel, ids: list[int], kv_scales: tuple[float, ...] = ()
) -> torch.Tensor:
    """Float32 logits of the last position of `ids`; with `kv_scales`, K and V pass through
    e4m3 as an FP8 pool stores them (value / scale in e4m3, times scale on read)."""
    cfg, device = model.cfg, model.device
    causal = causal_attend(1, len(ids), cfg.num_heads, cfg.num_kv_heads)

    def attend(
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if kv_scales:
            ks, vs = kv_scales[2 * layer], kv_scales[2 * layer + 1]
            k = quantize_static(k, ks).float().mul(ks).to(k.dtype)
            v = quantize_static(v, vs).float().mul(vs).to(v.dtype)
        return causal(layer, q, k, v, out_scale)

    with torch.inference_mode():
        t = torch.tensor(ids, device=device)
        hidden = model(t, torch.arange(len(ids), device=device), attend)
        return model.compute_logits(hidden)[-1].float()


def rounded_to_e4m3_per_head(q: torch.Tensor) -> torch.Tensor:
    """q as the Triton decode with e4m3 scores (`DecodeTiles.scores_fp8`) takes it: fp16,
    then e4m3 with one scale a head (its largest magnitude to 448)."""
    q = q.half().float()
    scale = (q.abs().amax(-1, keepdim=True) / 448).clamp(min=1e-30)
    return (q / scale).to(torch.float8_e4m3fn).float() * scale


def first_difference(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (None: equal)."""
    if ref == got:
        return None
    return next(
        (k for k, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
        min(len(ref), len(got)),
    )


def assert_flip_at_near_tie(
    want: torch.Tensor, have: torch.Tensor, what: str, inclusive: bool = False
) -> float:
    """The margin rule at one flipped step: reference logits `want`, FP8 logits `have`.
    Returns the logit error."""
    err = float((want - have).abs().max())
    top2 = want.topk(2).values
    margin = float(top2[0] - top2[1])
    ok = margin <= 2 * err if inclusive else margin < 2 * err
    assert ok, f"{what}: flipped at margin {margin:.4f} with logit error {err:.4f}"
    return err


GPU_TEXTS = ("The river runs past the old mill", "The baker opens his shop", "Hello", "The")
GPU_GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@dataclass
class MarginReport:
    """What `greedy_margin_check` saw: how many continuations were equal, and for each other
    one its first differing token and the logit error there."""

    exact: int = 0
    first_flips: list[int] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)


def greedy_margin_check(
    dense: LLMEngine,
    fp8: LLMEngine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    *,
    inclusive: bool = False,
) -> MarginReport:
    """Run the same greedy requests on two engines to completion and apply the margin rule
    where their continuations differ (`inclusive`: <=, for bf16's coarse logits, where a flip
    at exactly twice the error has been seen); the FP8 side is teacher-forced through its
    engine's model and KV scales."""
    outs = []
    for engine in (dense, fp8):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, sampling)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
        outs.append(got)
    report = MarginReport()
    for i, prompt in enumerate(prompts):
        ref, have = outs[0][f"r{i}"], outs[1][f"r{i}"]
        t = first_difference(ref, have)
        if t is None:
            report.exact += 1
            continue
        report.first_flips.append(t)
        seq = prompt + ref[:t]
        want = teacher_forced_logits(dense.model, seq)
        got_logits = teacher_forced_logits(fp8.model, seq, fp8.kv_cache.spec.scales)
        what = f"prompt {i}, token {t}"
        report.errors.append(assert_flip_at_near_tie(want, got_logits, what, inclusive))
    return report


def hf_on(checkpoint: Path) -> torch.nn.Module:
    """transformers on a compressed-tensors checkpoint (float32): it emulates the scheme."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(
    hf: torch.nn.Module, prompt: list[int], max_tokens: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and its top-2 logit gap at every step."""
    ids, gaps = list(prompt), []
    for _ in range(max_tokens):
        logits = hf(torch.tensor([ids])).logits[0, -1]
        top2 = logits.topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], gaps


def parted_at(want: list[int], got: list[int]) -> int | None:
    """`first_difference` of two continuations of the same length (a ValueError otherwise)."""
    if len(want) != len(got):
        raise ValueError(f"continuations of {len(want)} and {len(got)} tokens")
    return first_difference(want, got)


def margin_check_against_transformers(
    hf: torch.nn.Module, model: LlamaModel, prompts: list[list[int]], got: list[list[int]]
) -> MarginReport:
    """The margin rule (module docstring) between transformers' greedy continuations and the
    engine's (`got`, from `model`): where they part, both are teacher-forced on the
    reference's prefix and the reference's top-2 gap must be below twice the largest logit
    difference there."""
    report = MarginReport()
    for i, (prompt, tokens) in enumerate(zip(prompts, got, strict=True)):
        want, _ = reference_greedy(hf, prompt, len(tokens))
        t = parted_at(want, tokens)
        if t is None:
            report.exact += 1
            continue
        report.first_flips.append(t)
        seq = prompt + want[:t]
        with torch.inference_mode():
            ref_logits = hf(torch.tensor([seq])).logits[0, -1].float()
        have = teacher_forced_logits(model, seq)
        report.errors.append(assert_flip_at_near_tie(ref_logits, have, f"prompt {i}, token {t}"))
    return report
