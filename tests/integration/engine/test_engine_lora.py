"""LoRA requests through the engine (CPU, the tiny model, adapters made by `peft`): tokens
equal `peft`'s own model in transformers, colocated and across a prefill-only → decode-only
hand-off; three adapters and the base model in one batch; the adapter is part of the prefix
identity; more adapters than slots; adapters loaded and unloaded while requests run; every
way out of the engine gives the slot back; and what is refused, naming the adapter."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_factories import greedy, make_engine, record_batches, tokens_of
from lora_reference import ATTENTION, MLP, make_adapter, peft_model
from lora_reference import greedy as peft_greedy_tokens
from references import Reference
from step_faults import fail_first_execute

from engine.config import EngineMode
from engine.core.driver import EngineDriver
from engine.core.engine import LLMEngine
from engine.lora.lora_adapter import WEIGHTS_FILE
from engine.lora.lora_cache import LoraCache, LoraLoadError, LoraNotFound
from engine.modeling.llama import LlamaModel
from vocabulary.block_hash import hash_chain, hash_extra
from vocabulary.engine_io import FinishReason, PriorOutput, RequestOutput
from vocabulary.tokenizer import Tokenizer

MAX_TOKENS = 12
ADAPTERS: dict[str, dict[str, object]] = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp4": {"r": 4, "lora_alpha": 8, "target_modules": MLP, "use_rslora": True},
    "all16": {"r": 16, "lora_alpha": 32, "target_modules": ATTENTION + MLP},
    "od8": {"r": 8, "lora_alpha": 8, "target_modules": ["o_proj", "down_proj"]},
}
PeftGreedy = Callable[[str, list[int], int], list[int]]
EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-lora")
    return {
        name: make_adapter(tiny_model_dir, root / name, 10 + seed, **lora)
        for seed, (name, lora) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def peft_models(tiny_model_dir: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    return {name: peft_model(tiny_model_dir, path) for name, path in adapters.items()}


@pytest.fixture(scope="module")
def peft_greedy(peft_models: dict[str, Any], hf_greedy: Reference) -> PeftGreedy:
    """Greedy tokens of peft's model of an adapter ("": plain transformers), memoized."""
    memo: dict[tuple[str, tuple[int, ...], int], list[int]] = {}

    def run(name: str, prompt: list[int], max_tokens: int) -> list[int]:
        if not name:
            return hf_greedy(prompt, max_tokens)
        key = (name, tuple(prompt), max_tokens)
        if key not in memo:
            memo[key] = peft_greedy_tokens(peft_models[name], prompt, max_tokens)
        return memo[key]

    return run


@pytest.fixture()
def make(
    tiny_model_dir: Path,
    tiny_model: LlamaModel,
    tokenizer: Tokenizer,
    adapters: dict[str, Path],
) -> EngineFactory:
    """An engine on the shared tiny model with `names` (and `loras`) registered at start."""

    def build(*names: str, loras: tuple[tuple[str, str], ...] = (), **overrides: Any) -> LLMEngine:
        loras = tuple((n, str(adapters[n])) for n in names) + loras
        return make_engine(tiny_model_dir, tiny_model, tokenizer, loras=loras, **overrides)

    return build


def cache_of(engine: LLMEngine) -> LoraCache:
    assert engine.loras.cache is not None
    return engine.loras.cache


def warm(engine: LLMEngine, *names: str) -> None:
    """Read adapters into the host cache (what a first request starts), so that the next
    acquires get a slot at once (on CPU the upload is synchronous)."""
    cache = cache_of(engine)
    for name in names:
        if cache.acquire(name) is not None:
            cache.release(name)
    cache.wait_for_loads(timeout=30)


def run_all(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until nothing is unfinished (every output, by request id). A step that gives
    nothing waits for the adapter reads in flight, as an idle worker would."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return outputs
        step = engine.step()
        for out in step:
            outputs.setdefault(out.request_id, []).append(out)
        if not step and engine.loras.cache is not None:
            engine.loras.cache.wait_for_loads(timeout=30)
    raise AssertionError("engine did not finish within 10000 steps")


def assert_no_slot_held(engine: LLMEngine) -> None:
    cache = cache_of(engine)
    assert {name: cache.refs(name) for name in ADAPTERS} == dict.fromkeys(ADAPTERS, 0)
    assert all(r.lora_slot == -1 for r in engine.scheduler.requests.values())


# ---- serving: equal to peft ---------------------------------------------------------------


def test_greedy_tokens_on_an_adapter_equal_peft_generate(
    make: EngineFactory, peft_models: dict[str, Any], prompts: list[list[int]],
    hf_greedy: Reference,
) -> None:  # fmt: skip
    engine = make("all16")
    prompt = prompts[2]
    engine.add_request("a", prompt, greedy(MAX_TOKENS), lora_name="all16")
    out = run_all(engine)["a"]
    with torch.inference_mode():
        ids = (
            peft_models["all16"]
            .generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),  # (pad 0 is bos too)
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0]
            .tolist()
        )
    assert tokens_of(out) == ids[len(prompt) :]
    assert len(ids) == len(prompt) + MAX_TOKENS  # (no eos: every token was compared)
    assert tokens_of(out) != hf_greedy(prompt, MAX_TOKENS)  # the adapter changes the output
    assert out[-1].finish_reason is FinishReason.LENGTH
    assert_no_slot_held(engine)


def test_three_adapters_and_the_base_model_in_one_batch_each_equal_their_reference(
    make: EngineFactory, peft_greedy: PeftGreedy, prompts: list[list[int]]
) -> None:
    engine = make("qv8", "mlp4", "all16")
    warm(engine, "qv8", "mlp4", "all16")
    batches = record_batches(engine)
    rows = {"r0": "qv8", "r1": "", "r2": "mlp4", "r3": "all16", "r4": "qv8"}
    for i, (rid, name) in enumerate(rows.items()):
        engine.add_request(rid, prompts[i], greedy(MAX_TOKENS), lora_name=name)
    outputs = run_all(engine)
    for i, (rid, name) in enumerate(rows.items()):
        assert tokens_of(outputs[rid]) == peft_greedy(name, prompts[i], MAX_TOKENS), rid
    cache = cache_of(engine)
    slots = {"": -1} | {n: cache.slot_of(n) for n in ("qv8", "mlp4", "all16")}
    first, decode = batches[0], batches[1]
    assert {c.request_id: c.lora_slot for c in first.chunks} == {
        rid: slots[name] for rid, name in rows.items()
    }  # every row prefilled in the first step, each on its own adapter's slot
    assert decode.is_decode_only and len({c.lora_slot for c in decode.chunks}) == 4
    assert_no_slot_held(engine)


def test_a_migrated_request_on_an_adapter_continues_its_run(
    make: EngineFactory, peft_greedy: PeftGreedy, prompts: list[list[int]]
) -> None:
    engine = make("qv8")
    want = peft_greedy("qv8", prompts[0], 16)
    prior = PriorOutput(tuple(want[:5]), 0)
    engine.add_request("moved", prompts[0], greedy(16), lora_name="qv8", prior=prior)
    assert tokens_of(run_all(engine)["moved"]) == want[5:]


# ---- the prefix cache ---------------------------------------------------------------------


def test_a_cached_prefix_is_never_shared_across_adapters_or_with_the_base_model(
    make: EngineFactory, prompts: list[list[int]]
) -> None:
    engine = make("qv8", "mlp4")
    prompt = prompts[2]  # three full blocks
    cached: dict[str, int] = {}
    for rid, name in [("a", "qv8"), ("b", "mlp4"), ("base", ""), ("a-again", "qv8")]:
        engine.add_request(rid, prompt, greedy(4), lora_name=name)
        cached[rid] = run_all(engine)[rid][-1].num_cached_prompt_tokens
    assert cached == {"a": 0, "b": 0, "base": 0, "a-again": 48}
    extras = {hash_extra(engine.model_id, "", name) for name in ("", "qv8", "mlp4")}
    assert len(extras) == 3 and hash_extra(engine.model_id) in extras


# ---- more adapters than slots -------------------------------------------------------------


def test_more_adapters_than_slots_evict_and_every_request_is_exact(
    make: EngineFactory, peft_greedy: PeftGreedy, prompts: list[list[int]]
) -> None:
    names = list(ADAPTERS)
    engine = make(*names, max_loras=2, max_cpu_loras=4)
    batches = record_batches(engine)
    rows = [(f"r{i}", names[i % 4], prompts[i]) for i in range(8)]  # a b c d a b c d
    for rid, name, prompt in rows:
        engine.add_request(rid, prompt, greedy(MAX_TOKENS), lora_name=name)
    outputs = run_all(engine)
    for rid, name, prompt in rows:
        assert tokens_of(outputs[rid]) == peft_greedy(name, prompt, MAX_TOKENS), rid
        assert outputs[rid][-1].finish_reason is FinishReason.LENGTH
    assert max(len({c.lora_slot for c in b.chunks}) for b in batches) == 2
    stats = cache_of(engine).stats
    assert stats.num_evictions >= 2 and stats.num_disk_loads == 4
    assert_no_slot_held(engine)


def test_a_preempted_request_gives_its_slot_back_and_is_exact_after_recompute(
    make: EngineFactory, peft_greedy: PeftGreedy, prompts: list[list[int]]
) -> None:
    engine = make("qv8", "mlp4", num_kv_blocks=8)
    warm(engine, "qv8", "mlp4")
    rows = [("p0", "qv8", prompts[2]), ("p1", "mlp4", prompts[0]), ("p2", "", prompts[4])]
    for rid, name, prompt in rows:
        engine.add_request(rid, prompt, greedy(24), lora_name=name)
    outputs = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid, name, prompt in rows:
        assert tokens_of(outputs[rid]) == peft_greedy(name, prompt, 24), rid
    assert_no_slot_held(engine)


# ---- run-time load and unload ---------------------------------------------------------------


def test_adapters_load_and_unload_while_requests_run(
    make: EngineFactory, adapters: dict[str, Path], peft_greedy: PeftGreedy,
    prompts: list[list[int]],
) -> None:  # fmt: skip
    engine = make("qv8")
    engine.add_request("long", prompts[2], greedy(40), lora_name="qv8")
    outputs: dict[str, list[RequestOutput]] = {"long": []}
    while not outputs["long"]:  # until it has produced a token
        outputs["long"] += engine.step()
        cache_of(engine).wait_for_loads(timeout=30)
    engine.load_lora("mlp4", str(adapters["mlp4"]))  # while "long" runs
    engine.load_lora("mlp4", str(adapters["mlp4"]))  # the same folder again: nothing
    engine.add_request("new", prompts[0], greedy(MAX_TOKENS), lora_name="mlp4")
    assert engine.scheduler.requests["long"].lora_slot >= 0  # running on its slot
    assert engine.unload_lora("qv8") and not engine.unload_lora("qv8")
    assert [i.name for i in engine.list_loras()] == ["mlp4"]
    with pytest.raises(LoraNotFound, match="'qv8' is not loaded on this worker"):
        engine.add_request("late", prompts[1], greedy(4), lora_name="qv8")
    for rid, outs in run_all(engine).items():
        outputs.setdefault(rid, []).extend(outs)
    assert tokens_of(outputs["long"]) == peft_greedy("qv8", prompts[2], 40)
    assert tokens_of(outputs["new"]) == peft_greedy("mlp4", prompts[0], MAX_TOKENS)
    cache = cache_of(engine)
    assert cache.names() == ("mlp4",) and cache.refs("qv8") == 0
    assert cache.stats.num_resident == 1  # qv8's slot went with its last request
    engine.load_lora("qv8", str(adapters["qv8"]))  # and the name is free again
    assert [(i.name, i.path, i.rank) for i in engine.list_loras()] == [
        ("mlp4", str(adapters["mlp4"]), 4),
        ("qv8", str(adapters["qv8"]), 8),
    ]


@pytest.mark.parametrize("mode", [EngineMode.COLOCATED, EngineMode.SPLIT])
def test_unloading_an_adapter_ends_the_requests_waiting_for_it(
    make: EngineFactory, prompts: list[list[int]], mode: EngineMode
) -> None:
    """(A split engine's waiting requests are its prefill lane's.)"""
    engine = make("qv8", "mlp4", mode=mode)
    engine.add_request("cold", prompts[0], greedy(8), lora_name="qv8")  # not read yet
    engine.add_request("base", prompts[1], greedy(8))
    assert engine.unload_lora("qv8")
    outputs = run_all(engine)
    [ended] = outputs["cold"]
    assert ended.finish_reason is FinishReason.ABORT and ended.new_token_ids == ()
    assert ended.abort_reason == "lora adapter 'qv8' was unloaded before it ran"
    assert isinstance(ended.abort_error, LoraNotFound)  # a worker's reader raises it: NOT_FOUND
    assert tokens_of(outputs["base"]) and outputs["base"][-1].abort_reason == ""
    assert_no_slot_held(engine)


def test_an_adapter_whose_read_fails_ends_its_requests_with_the_reason(
    make: EngineFactory, adapters: dict[str, Path], prompts: list[list[int]], tmp_path: Path
) -> None:
    folder = tmp_path / "gone"
    shutil.copytree(adapters["qv8"], folder)
    engine = make(loras=(("gone", str(folder)),))
    (folder / WEIGHTS_FILE).unlink()  # after the check at registration
    engine.add_request("r", prompts[0], greedy(4), lora_name="gone")
    engine.add_request("base", prompts[1], greedy(4))
    outputs = run_all(engine)
    [ended] = outputs["r"]
    assert ended.finish_reason is FinishReason.ABORT
    assert ended.abort_reason.startswith(f"LoRA adapter 'gone' ({folder}): ")
    assert isinstance(ended.abort_error, LoraLoadError)
    assert len(tokens_of(outputs["base"])) == 4
    assert [(i.name, i.state) for i in engine.list_loras()] == [("gone", "failed")]
    with pytest.raises(LoraLoadError, match="'gone'"):
        engine.add_request("again", prompts[0], greedy(4), lora_name="gone")
    assert not engine.has_unfinished()
    assert_no_slot_held(engine)


def test_load_lora_refuses_what_it_cannot_serve_naming_the_adapter(
    make: EngineFactory, adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = make("qv8", max_lora_rank=8)
    with pytest.raises(ValueError, match=r"'qv8' is already loaded from .*qv8; unload it first"):
        engine.load_lora("qv8", str(adapters["mlp4"]))
    with pytest.raises(ValueError, match=r"'all16': .*r=16 is above .*max_lora_rank=8"):
        engine.load_lora("all16", str(adapters["all16"]))
    with pytest.raises(ValueError, match=r"'gone': .*not a directory"):
        engine.load_lora("gone", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="character ' ' is not allowed"):
        engine.load_lora("a b", str(adapters["mlp4"]))
    assert [i.name for i in engine.list_loras()] == ["qv8"]
    with pytest.raises(ValueError, match="'mlp4': LoRA is not enabled"):
        make().load_lora("mlp4", str(adapters["mlp4"]))


# ---- refused requests, and no slot left behind ---------------------------------------------


def test_an_unknown_adapter_or_lora_off_is_lora_not_found_and_queues_nothing(
    make: EngineFactory, prompts: list[list[int]]
) -> None:
    on, off = make("qv8"), make()
    with pytest.raises(LoraNotFound, match=r"lora adapter 'nope' is not loaded on this worker$"):
        on.add_request("x", prompts[0], greedy(4), lora_name="nope")
    with pytest.raises(LoraNotFound, match=r"'qv8' .* LoRA is not enabled .*--enable-lora"):
        off.add_request("x", prompts[0], greedy(4), lora_name="qv8")
    chain = hash_chain(prompts[2], 16, hash_extra(on.model_id, "", "nope"))
    with pytest.raises(LoraNotFound, match="'nope'"):
        on.allocate_for_transfer("t", prompts[2], chain, lora_name="nope")
    for engine in (on, off):
        assert not engine.has_unfinished() and engine.load().num_transfer_blocks == 0
    assert off.list_loras() == () and off.load().loras == ()


def test_every_way_out_gives_the_slot_back(make: EngineFactory, prompts: list[list[int]]) -> None:
    engine = make("qv8", "mlp4")
    engine.add_request("waiting", prompts[0], greedy(8), lora_name="qv8")
    engine.step()  # its adapter is being read: it waits
    assert engine.scheduler.requests["waiting"].lora_slot == -1
    assert engine.abort_request("waiting")
    warm(engine, "qv8", "mlp4")
    assert set(engine.load().loras) == {"qv8", "mlp4"}
    engine.add_request("running", prompts[1], greedy(8), lora_name="qv8")
    engine.step()
    assert engine.scheduler.requests["running"].lora_slot >= 0
    assert cache_of(engine).refs("qv8") == 1
    assert engine.abort_request("running")
    assert_no_slot_held(engine)


def test_a_failed_step_gives_back_the_slots_of_the_requests_it_aborts(
    make: EngineFactory, peft_greedy: PeftGreedy, prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    engine = make("qv8")
    warm(engine, "qv8")
    fail_first_execute(monkeypatch, engine.runner)
    finished: dict[str, RequestOutput] = {}
    failed: list[list[str]] = []
    driver = EngineDriver(
        engine,
        lambda outs: finished.update({o.request_id: o for o in outs if o.finished}),
        on_step_error=lambda e, ids: failed.append(ids),
    )
    driver.start()
    try:
        add = driver.call(lambda e: e.add_request("doomed", prompts[0], greedy(8), lora_name="qv8"))
        add.result(timeout=10)
        _wait_for(lambda: failed == [["doomed"]])
        assert driver.call(lambda e: cache_of(e).refs("qv8")).result(timeout=10) == 0
        add = driver.call(lambda e: e.add_request("after", prompts[0], greedy(8), lora_name="qv8"))
        add.result(timeout=10)
        _wait_for(lambda: "after" in finished)
    finally:
        driver.stop()
    assert finished["after"].num_output_tokens == 8
    assert_no_slot_held(engine)


def test_the_engine_loop_waits_for_a_cold_adapter_instead_of_spinning(
    make: EngineFactory, peft_greedy: PeftGreedy, prompts: list[list[int]]
) -> None:
    engine = make("mlp4")
    finished: dict[str, list[int]] = {}

    def on_outputs(outs: list[RequestOutput]) -> None:
        for out in outs:
            finished.setdefault(out.request_id, []).extend(out.new_token_ids)

    driver = EngineDriver(engine, on_outputs)
    driver.start()
    try:
        add = driver.call(lambda e: e.add_request("c", prompts[1], greedy(4), lora_name="mlp4"))
        add.result(timeout=10)
        _wait_for(lambda: len(finished.get("c", ())) == 4)
    finally:
        driver.stop()
    assert finished["c"] == peft_greedy("mlp4", prompts[1], 4)
    # After an idle step the loop waits IDLE_STEP_WAIT_S; spinning instead, it ran ~10^3
    # empty steps here, holding the GIL the read needs.
    assert driver.num_steps < 200


def _wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- the hand-off ------------------------------------------------------------------------


@pytest.fixture()
def pair(make: EngineFactory) -> tuple[LLMEngine, LLMEngine]:
    return (
        make("all16", mode=EngineMode.PREFILL_ONLY, num_kv_blocks=32),
        make("all16", mode=EngineMode.DECODE_ONLY, num_kv_blocks=32),
    )


def test_a_prefill_on_an_adapter_handed_off_decodes_equal_to_peft(
    pair: tuple[LLMEngine, LLMEngine], peft_greedy: PeftGreedy, prompts: list[list[int]]
) -> None:
    p, d = pair
    prompt, params = prompts[2], greedy(MAX_TOKENS)
    p.add_request("h", prompt, params, lora_name="all16")
    [out] = run_all(p)["h"]
    handoff = out.kv_handoff
    assert handoff is not None and out.finish_reason is FinishReason.HANDOFF
    assert list(handoff.block_hashes) == hash_chain(prompt, 16, hash_extra(p.model_id, "", "all16"))
    assert cache_of(p).refs("all16") == 0  # kept blocks need no slot
    assert [i.state for i in d.list_loras()] == ["registered"]  # cold on the decode side
    alloc = d.allocate_for_transfer("h", prompt, handoff.block_hashes, lora_name="all16")
    assert d.scheduler.transferring["h"].lora_slot == -1  # not resident: its read started
    assert [i.state for i in d.list_loras()] in (["loading"], ["host"])
    d.kv_cache.copy_blocks_from(p.kv_cache, list(handoff.block_ids), list(alloc.blocks_to_transfer))
    assert p.release_request_blocks("h")
    d.add_transferred_request("h", handoff.first_token_id, params)
    decoded = run_all(d)["h"]
    want = peft_greedy("all16", prompt, MAX_TOKENS)
    assert [handoff.first_token_id, *tokens_of(decoded)] == want
    assert cache_of(d).stats.num_disk_loads == 1
    assert_no_slot_held(p)
    assert_no_slot_held(d)


def test_a_transfer_freed_or_its_request_aborted_gives_the_slot_back(
    pair: tuple[LLMEngine, LLMEngine], prompts: list[list[int]]
) -> None:
    _, d = pair
    warm(d, "all16")
    chain = hash_chain(prompts[2], 16, hash_extra(d.model_id, "", "all16"))
    d.allocate_for_transfer("t", prompts[2], chain, lora_name="all16")
    assert d.scheduler.transferring["t"].lora_slot >= 0 and cache_of(d).refs("all16") == 1
    assert d.free_transfer_blocks("t")
    d.allocate_for_transfer("u", prompts[2], chain, lora_name="all16")
    assert d.abort_request("u")
    assert_no_slot_held(d)
    assert d.block_pool.num_free == d.block_pool.num_blocks


# ---- start-up ----------------------------------------------------------------------------


def test_an_adapter_that_does_not_fit_fails_start_up_naming_it(
    make: EngineFactory, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"'all16': .*r=16 is above .*max_lora_rank=8"):
        make("qv8", "all16", max_lora_rank=8)
    with pytest.raises(ValueError, match=r"'gone': .*nowhere: not a directory"):
        make(loras=(("gone", str(tmp_path / "nowhere")),))
    with pytest.raises(ValueError, match="loras: adapter 'qv8' is given twice"):
        make("qv8", "qv8")
