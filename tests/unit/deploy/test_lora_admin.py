"""The controller's LoRA fan-out (deploy/control/lora_admin.py) over fake worker handles: a load
reaches every worker or, when one refuses, none keeps it; an unload of an unknown name is
NOT_FOUND; the list merges what each worker says; a late worker is brought in line."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from actor_fakes import AsyncMethod as _Method

from deploy.control import lora_admin
from router.control import LoraRefused
from vocabulary.engine_io import LoraInfo


class Worker:
    """A worker's adapter registry; `refuse` makes its load raise as the engine would."""

    def __init__(self, refuse: str = "", held: tuple[str, ...] = ()) -> None:
        self.adapters: dict[str, str] = {}
        self.refuse = refuse
        self.held = held
        self.load_lora = _Method(self._load)
        self.unload_lora = _Method(lambda name: self.adapters.pop(name, None) is not None)
        self.list_loras = _Method(self._list)

    def _load(self, name: str, path: str) -> LoraInfo:
        if self.refuse:
            raise ValueError(self.refuse)
        self.adapters[name] = path
        return LoraInfo(name, path, 8, "registered")

    def _list(self) -> tuple[LoraInfo, ...]:
        return tuple(
            LoraInfo(n, p, 8, "resident" if n in self.held else "registered")
            for n, p in self.adapters.items()
        )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_load_reaches_every_worker_and_the_list_shows_who_holds_it() -> None:
    workers = {"p0": Worker(held=("a",)), "d0": Worker()}
    run(lora_admin.register_everywhere(workers, {}, "a", "/x/a"))
    assert all(w.adapters == {"a": "/x/a"} for w in workers.values())
    entries = run(lora_admin.list_everywhere(workers, {"a": "/x/a"}))
    assert [(e.name, e.path, e.rank, e.workers, e.loaded_on) for e in entries] == [
        ("a", "/x/a", 8, ("d0", "p0"), ("p0",))
    ]


def test_a_worker_that_refuses_the_adapter_undoes_the_load_everywhere() -> None:
    workers = {"p0": Worker(), "d0": Worker(refuse="rank 128 > max_lora_rank 64")}
    with pytest.raises(LoraRefused, match=r"adapter 'a' at /x/a: d0: rank 128 > max_lora_rank"):
        run(lora_admin.register_everywhere(workers, {}, "a", "/x/a"))
    assert workers["p0"].adapters == {}


def test_a_name_taken_by_another_path_is_refused_before_any_worker_is_asked() -> None:
    workers = {"p0": Worker()}
    with pytest.raises(LoraRefused, match="already loaded from /x/a; unload it first"):
        run(lora_admin.register_everywhere(workers, {"a": "/x/a"}, "a", "/y/a"))
    assert workers["p0"].adapters == {}


def test_an_unload_removes_it_everywhere_and_an_unknown_name_is_not_found() -> None:
    workers = {"p0": Worker(), "d0": Worker()}
    run(lora_admin.register_everywhere(workers, {}, "a", "/x/a"))
    run(lora_admin.unregister_everywhere(workers, {"a": "/x/a"}, "a"))
    assert all(w.adapters == {} for w in workers.values())
    with pytest.raises(LoraRefused) as err:
        run(lora_admin.unregister_everywhere(workers, {}, "a"))
    assert err.value.not_found


def test_a_worker_that_started_while_the_set_changed_is_brought_in_line() -> None:
    late = Worker()
    late.adapters = {"gone": "/x/gone", "a": "/old/a"}
    done = run(lora_admin.sync_worker(late, {"a": "/x/a", "b": "/x/b"}))
    assert late.adapters == {"a": "/x/a", "b": "/x/b"}
    assert done == "loaded a, loaded b, unloaded gone"
    assert run(lora_admin.sync_worker(late, {"a": "/x/a", "b": "/x/b"})) == ""
