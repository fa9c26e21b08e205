"""Scheduler with LoRA slots (a fake `AdapterSlots`): a request runs only while it holds its
adapter's slot, a cold adapter never holds up the requests behind it, and every way out of
the running set gives the slot back exactly once."""

from __future__ import annotations

from scheduler_factories import FakeSlots, make_request, make_scheduler, run_step

from engine.core.request import RequestStatus
from engine.core.scheduler import Scheduler
from engine.lora.lora_cache import LoraLoadError, LoraNotFound


def lora_scheduler(**kwargs: object) -> tuple[Scheduler, FakeSlots]:
    slots = FakeSlots({"a": 0, "b": 1})
    return make_scheduler(adapters=slots, **kwargs), slots  # type: ignore[arg-type]


def slots_of(s: Scheduler) -> dict[str, int]:
    return {c.request_id: c.lora_slot for c in run_step(s).batch.chunks}


def test_a_cold_adapter_waits_in_place_and_the_requests_behind_it_run() -> None:
    s, slots = lora_scheduler()
    slots.resident = {"b"}
    s.add_request(make_request("cold", lora_name="a"))
    s.add_request(make_request("base", first_token=200))
    s.add_request(make_request("warm", first_token=300, lora_name="b"))
    assert slots_of(s) == {"base": -1, "warm": 1}
    assert [r.request_id for r in s.waiting] == ["cold"]
    assert s.requests["cold"].status is RequestStatus.WAITING
    slots.resident.add("a")
    assert slots_of(s) == {"base": -1, "warm": 1, "cold": 0}
    assert slots.held() == {"a": 1, "b": 1}


def test_fcfs_holds_behind_a_request_that_does_not_fit_and_its_slot_is_given_back() -> None:
    s, slots = lora_scheduler(num_blocks=4)
    slots.resident = {"a", "b"}
    s.add_request(make_request("big", prompt_len=20, lora_name="a"))  # 5 blocks of 4
    s.add_request(make_request("small", first_token=200, lora_name="b"))
    assert slots_of(s) == {}  # "big" does not fit: nothing behind it jumps the queue
    assert slots.held() == {} and slots.num_acquires["b"] == 0


def test_finish_abort_and_preemption_release_the_slot_once() -> None:
    s, slots = lora_scheduler(num_blocks=4)
    slots.resident = {"a", "b"}
    s.add_request(make_request("old", prompt_len=7, lora_name="a"))
    s.add_request(make_request("new", prompt_len=7, first_token=200, lora_name="b"))
    run_step(s)
    assert slots.held() == {"a": 1, "b": 1}
    for _ in range(2):  # both grow into a third block: "new" is preempted
        out = run_step(s)
    assert out.preempted == ("new",) and slots.held() == {"a": 1}
    assert s.requests["new"].lora_slot == -1
    s.finish(s.requests["old"], RequestStatus.FINISHED_STOPPED)
    assert slots.held() == {}
    assert slots_of(s) == {"new": 1}  # re-admitted: acquired again
    assert s.abort("new") and slots.held() == {}


def test_an_adapter_that_can_never_run_ends_its_request_with_the_reason() -> None:
    s, slots = lora_scheduler()
    slots.errors = {
        "a": LoraLoadError("LoRA adapter 'a' (/x/a): holds non-finite values"),
        "b": LoraNotFound("LoRA adapter 'b' is not registered"),
    }
    s.add_request(make_request("r1", lora_name="a"))
    s.add_request(make_request("r2", first_token=200, lora_name="b"))
    s.add_request(make_request("r3", first_token=300))
    out = s.schedule()
    assert [c.request_id for c in out.batch.chunks] == ["r3"]
    ended = {r.request_id: (r.status, r.abort_error) for r in out.finished}
    assert ended == {
        "r1": (RequestStatus.FINISHED_ABORTED, slots.errors["a"]),  # the cache's own errors
        "r2": (RequestStatus.FINISHED_ABORTED, slots.errors["b"]),
    }
    assert set(s.requests) == {"r3"} and not s.waiting


def test_any_other_acquire_failure_ends_only_its_request_as_a_load_error() -> None:
    s, slots = lora_scheduler()
    slots.errors = {"a": RuntimeError("CUDA error: the upload failed")}
    s.add_request(make_request("r1", lora_name="a"))
    s.add_request(make_request("r2", first_token=300))
    out = s.schedule()
    assert [c.request_id for c in out.batch.chunks] == ["r2"]
    [ended] = out.finished
    assert isinstance(ended.abort_error, LoraLoadError)
    assert str(ended.abort_error) == "lora adapter 'a': CUDA error: the upload failed"


def test_a_transfer_holds_its_slot_and_a_cold_one_runs_once_it_gets_one() -> None:
    s, slots = lora_scheduler()
    slots.resident = {"b"}
    warm, cold = make_request("warm", lora_name="b"), make_request("cold", 8, lora_name="a")
    for r in (warm, cold):
        reserved = s.reserve_transfer(
            r.request_id, r.prompt_token_ids, r.block_hashes, r.hash_extra, r.lora_name
        )
        assert reserved.lora_slot == (1 if r is warm else -1)
        r.append_output(55, None)
        s.add_transferred(r)
    s.add_request(make_request("base", first_token=300))
    assert slots_of(s) == {"base": -1, "warm": 1}  # "cold" sits in `running`, unscheduled
    assert cold.status is RequestStatus.RUNNING and cold.lora_slot == -1
    slots.resident.add("a")
    assert slots_of(s) == {"warm": 1, "cold": 0, "base": -1}
    assert slots.held() == {"a": 1, "b": 1}


def test_a_freed_transfer_gives_its_slot_back() -> None:
    s, slots = lora_scheduler()
    slots.resident = {"a"}
    r = make_request("t", lora_name="a")
    s.reserve_transfer("t", r.prompt_token_ids, r.block_hashes, r.hash_extra, "a")
    assert slots.held() == {"a": 1}
    s.free_transfer("t")
    assert slots.held() == {} and s.block_pool.num_free == 16
