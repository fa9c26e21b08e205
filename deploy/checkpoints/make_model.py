"""`pdserve make-model`: write a Llama-architecture checkpoint in Hugging Face format.

Presets:
- `tiny` (the embedded default and the tests' model): ~1M parameters, a byte-level BPE
  tokenizer trained offline on deploy/data/corpus.txt, and a few seconds of training on that
  text, so the demo prints text-like output. After training the final norm is scaled up
  (`sharpen`), which multiplies every logit by the same factor: greedy choices are unchanged
  but their margins grow, so token-exact agreement checks against transformers test the engine,
  not float rounding luck.
- `llama3-8b`: Llama-3-8B shapes with random weights (bf16 by default, no training) for GPU
  benchmarks; written in ~5 GB shards with an index.
- `llama3-70b`: Llama-3-70B shapes, meant for `config_only` (config.json and the tiny
  model's tokenizer, no weights) and `--load-format dummy`: the engine makes the weights on
  the device. The tokenizer's 512 tokens are fewer than the model's 128256, which is fine for
  random weights (ids past the tokenizer's decode to no text).

`fp8` writes the checkpoint in the compressed-tensors FP8 format (deploy/checkpoints/fp8_writer.py);
`int_scheme` in its INT8 W8A8 or INT4 W4A16 formats (deploy/checkpoints/int_writer.py).

Output is deterministic for a given seed on a given machine (training runs single-threaded).
Everything is built locally; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from deploy.checkpoints.checkpoint_files import CORPUS, save_shards, staged_dir
from deploy.checkpoints.fp8_writer import corpus_ids, observe_input_amax, quantize_tensors
from deploy.checkpoints.gptq_calibration import input_hessians
from deploy.checkpoints.int_writer import check_calibration, quantize_int_tensors
from engine.loading.fp8_checkpoint import Fp8Scheme
from engine.loading.int_checkpoint import IntScheme
from vocabulary.model_config import ModelConfig, RopeConfig

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
TINY_FORMAT_VERSION = 3  # bump when the tiny model's recipe changes (invalidates caches)
# The chat template tokenizer_config.json carries (the router's OpenAI chat API renders it
# with transformers): plain "User:" / "Assistant:" turns, like the corpus's prose. With
# `tools` a preamble lists them (one JSON line each) and says how to call them: the
# assistant answers with a JSON array of calls, `[{"name": ..., "arguments": {...}}]`, the
# format the router constrains and parses (router/http/tools.py). An assistant message's
# `tool_calls` render in that format, a `tool` message as a "Tool:" turn. A conversation
# without tools renders as it did before tools were known.
TOOL_CALL = (
    "{% set f = call['function'] if call['function'] is defined else call %}"
    '{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}"
    "{% else %}{{ f['arguments'] | tojson }}{% endif %}}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}Tools (call them by answering with a JSON array of calls, "
    '[{"name": ..., "arguments": {...}}]):\n'
    "{% for tool in tools %}"
    "{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}\n"
    "{% endfor %}{{ '\\n' }}{% endif %}"  # (a newline right after a tag is trimmed)
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] | trim }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] | trim }}\n"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "Assistant: {% if message['content'] %}{{ message['content'] | trim }} {% endif %}["
    "{% for call in message['tool_calls'] %}{% if not loop.first %}, {% endif %}"
    + TOOL_CALL
    + "{% endfor %}]{{ eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}"
    "Assistant: {{ message['content'] | trim }}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}Tool: {{ message['content'] | trim }}\n"
    "{% else %}{{ raise_exception('roles are system, user, assistant or tool') }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """A generated checkpoint: the architecture it declares and how its weights are made.

    make-model's options name a field of `config` or of the recipe (`with_options`)."""

    config: ModelConfig
    """The architecture config.json declares (Llama); its token ids are left unset here: the
    tokenizer's are written (`hf_config`)."""
    tokenizer_vocab: int = 512  # BPE vocabulary trained on the corpus (<= vocab_size)
    train_steps: int = 0
    sharpen: float = 1.0
    init_std: float = 0.02

    def with_options(self, **options: object) -> ModelShape:
        """This shape with `options` replacing fields of its config or of its recipe (an
        unknown name is a TypeError); head_dim is hidden_size // num_heads unless given."""
        architecture = {f.name for f in fields(ModelConfig)}
        on_config = {k: v for k, v in options.items() if k in architecture}
        on_recipe = {k: v for k, v in options.items() if k not in architecture}
        config = replace(self.config, **on_config)  # type: ignore[arg-type]
        if "head_dim" not in on_config:
            config = replace(config, head_dim=config.hidden_size // config.num_heads)
        return replace(self, config=config, **on_recipe)  # type: ignore[arg-type]


_TINY = ModelConfig(
    model_type="llama",
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope=RopeConfig(theta=10000.0),
    tie_word_embeddings=False,
    attention_bias=False,
    o_proj_bias=False,
    qk_norm=False,
    bos_token_id=None,
    eos_token_ids=(),
    torch_dtype="float32",
)
_LLAMA3_8B = replace(
    _TINY,
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rope=RopeConfig(
        theta=500000.0,
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    torch_dtype="bfloat16",
)
PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(_TINY, train_steps=150, sharpen=4.0),
    "llama3-8b": ModelShape(_LLAMA3_8B),
    "llama3-70b": ModelShape(
        replace(_LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64)
    ),
}


def build_tokenizer(vocab_size: int, max_length: int) -> tuple[object, dict[str, object]]:
    """A byte-level BPE tokenizer trained on the bundled corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS.read_text()], trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return tok, tokenizer_config


def hf_config(shape: ModelShape, bos_id: int, eos_id: int) -> dict[str, object]:
    """The config.json of `shape` with the tokenizer's token ids; ValueError for an
    architecture a Llama config.json cannot declare."""
    c = shape.config
    if c.model_type != "llama" or c.qk_norm or c.o_proj_bias != c.attention_bias:
        raise ValueError(f"make-model writes Llama checkpoints, not {c.model_type} ones")
    if c.sliding_window is not None:
        raise ValueError("make-model writes Llama checkpoints (no sliding window)")
    rope: dict[str, object] = {"rope_type": c.rope.kind, "rope_theta": c.rope.theta}
    scaled = c.rope.kind != "default"
    if scaled:
        rope |= {
            "factor": c.rope.factor,
            "low_freq_factor": c.rope.low_freq_factor,
            "high_freq_factor": c.rope.high_freq_factor,
            "original_max_position_embeddings": c.rope.original_max_position_embeddings,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": c.rope.theta,
        "rope_scaling": rope if scaled else None,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        "dtype": c.torch_dtype,
        "use_cache": True,
    }


def random_tensors(
    cfg_dict: dict[str, object], shape: ModelShape, seed: int, device: str
) -> dict[str, torch.Tensor]:
    """Random weights under HF names: normal(0, init_std) matrices, unit norms."""
    from engine.loading.hf_checkpoint import expected_tensor_names

    cfg = ModelConfig.from_dict(cfg_dict)
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.config.torch_dtype)
    shapes = _hf_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for name in expected_tensor_names(cfg):
        s = shapes(name)
        if name.endswith("norm.weight"):
            out[name] = torch.ones(s, dtype=dtype)
        else:
            t = torch.empty(s, dtype=torch.float32, device=device)
            t.normal_(0.0, shape.init_std, generator=gen)
            out[name] = t.to(dtype).cpu()
    return out


def _hf_shapes(cfg: ModelConfig) -> Callable[[str], tuple[int, ...]]:
    h, q, kv, inter, v = (
        cfg.hidden_size,
        cfg.q_size,
        cfg.kv_size,
        cfg.intermediate_size,
        cfg.vocab_size,
    )
    table = {
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter),
        "layernorm.weight": (h,),
    }

    def shape_of(name: str) -> tuple[int, ...]:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (v, h)
        if name == "model.norm.weight":
            return (h,)
        for suffix, s in table.items():
            if name.endswith(suffix):
                return s
        raise KeyError(name)

    return shape_of


def train_tiny(
    tensors: dict[str, torch.Tensor],
    cfg_dict: dict[str, object],
    token_stream: list[int],
    shape: ModelShape,
    seed: int,
) -> dict[str, torch.Tensor]:
    """A few seconds of next-token training on the corpus; returns HF-named tensors."""
    from engine.loading.hf_checkpoint import hf_state_dict, load_weights
    from engine.modeling.llama import LlamaModel, causal_attend

    cfg = ModelConfig.from_dict(cfg_dict)
    model = LlamaModel(cfg, dtype=torch.float32)
    load_weights(model, iter(tensors.items()))
    params = [p for p in model.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    data = torch.tensor(token_stream, dtype=torch.long)
    batch, seq = 8, 64
    gen = torch.Generator().manual_seed(seed + 1)
    attend = causal_attend(batch, seq, cfg.num_heads, cfg.num_kv_heads)
    positions = torch.arange(seq).repeat(batch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic bytes for a given seed
    try:
        for step in range(shape.train_steps):
            starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
            window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
            inputs, targets = window[:, :-1].reshape(-1), window[:, 1:].reshape(-1)
            hidden = model(inputs, positions, attend)
            loss = torch.nn.functional.cross_entropy(model.compute_logits(hidden), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            lr = 3e-3 * min(1.0, (step + 1) / 20) * (1 - step / shape.train_steps) + 1e-4
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
    finally:
        torch.set_num_threads(threads)
    out = hf_state_dict(model)
    out["model.norm.weight"] = out["model.norm.weight"] * shape.sharpen
    return out


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    device: str = "cpu",
    shard_bytes: int = 5 << 30,
    *,
    fp8: Fp8Scheme | None = None,
    int_scheme: IntScheme | None = None,
    calibrate: bool = False,
    config_only: bool = False,
    **overrides: object,
) -> Path:
    """Write a checkpoint folder (config.json, safetensors, tokenizer files) and return it.

    `overrides`: options of the preset's ModelShape (`ModelShape.with_options`, e.g.
    num_layers=2, torch_dtype="bfloat16").
    `fp8`: the weights in that compressed-tensors FP8 scheme; `int_scheme`: in that INT8 or
    INT4 scheme (not with `fp8`); `calibrate`: INT4 rounded by GPTQ against the bundled
    corpus (deploy/checkpoints/gptq_calibration.py), not to nearest; `config_only`: no
    weights.
    The folder is written under a temporary name and renamed into place, so concurrent
    writers never see a half-written checkpoint.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if fp8 is not None and int_scheme is not None:
        raise ValueError("one quantization: fp8 or an int scheme, not both")
    if calibrate:
        check_calibration(int_scheme)
    shape = PRESETS[preset].with_options(**overrides)
    arch = shape.config
    if arch.hidden_size % arch.num_heads or arch.num_heads % arch.num_kv_heads:
        raise ValueError("hidden_size must divide by heads, and heads by kv heads")
    out = Path(out_dir)
    tok, tok_cfg = build_tokenizer(
        min(shape.tokenizer_vocab, arch.vocab_size), arch.max_position_embeddings
    )
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)  # type: ignore[attr-defined]
    cfg_dict = hf_config(shape, bos_id, eos_id)
    tensors = {} if config_only else random_tensors(cfg_dict, shape, seed, device)
    if shape.train_steps > 0 and not config_only:
        stream: list[int] = []
        for para in CORPUS.read_text().split("\n\n"):
            stream += [*tok.encode(para.strip()).ids, eos_id]  # type: ignore[attr-defined]
        tensors = train_tiny(tensors, cfg_dict, stream, shape, seed)
    if fp8 is not None:
        tensors = _quantized(tensors, ModelConfig.from_dict(cfg_dict), fp8, tok)
        cfg_dict["quantization_config"] = fp8.quantization_config()
    if int_scheme is not None:
        hessians = None
        if calibrate and tensors:
            ids = corpus_ids(None, tok)
            hessians = input_hessians(tensors, ModelConfig.from_dict(cfg_dict), ids)
        tensors = quantize_int_tensors(tensors, int_scheme, hessians)
        cfg_dict["quantization_config"] = int_scheme.quantization_config()
    with staged_dir(out) as tmp:
        if tensors:
            save_shards(tensors, tmp, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2)
        )
        tok.save(str(tmp / "tokenizer.json"))  # type: ignore[attr-defined]
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
        (tmp / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
        recipe = {"preset": preset, "seed": seed, **asdict(shape)}
        recipe |= {"fp8": asdict(fp8) if fp8 else None, "config_only": config_only}
        recipe |= {"int": asdict(int_scheme) if int_scheme else None}
        if calibrate:
            recipe["calibrate"] = "gptq"
        (tmp / "pdserve_recipe.json").write_text(json.dumps(recipe, indent=2))
    return out


def _quantized(
    tensors: dict[str, torch.Tensor], cfg: ModelConfig, scheme: Fp8Scheme, tok: object
) -> dict[str, torch.Tensor]:

    amax = None
    if tensors and not scheme.dynamic_activations:
        amax = observe_input_amax(tensors, cfg, corpus_ids(None, tok))
    return quantize_tensors(tensors, scheme, amax)


def cache_dir() -> Path:
    """pdserve's cache folder: $PDSERVE_CACHE_DIR or ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def cached_tiny_model(seed: int = 0) -> Path:
    """The tiny model in the cache folder, written on first use."""
    path = cache_dir() / "models" / f"tiny-v{TINY_FORMAT_VERSION}-seed{seed}"
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        make_model(path, preset="tiny", seed=seed)
    return path
