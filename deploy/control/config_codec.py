"""Plain data (what YAML reads and writes) to and from trees of frozen dataclasses, driven by
the dataclasses' fields and their types.

`from_data(cls, data, default)` builds a tree from nested mappings; `to_data(tree)` writes one
that `from_data` reads back to an equal tree. What a field's type may be, and how it is
written: a dataclass (a mapping of its fields; keys left out keep the default's value, an
empty section keeps them all), `X | None` (null), `tuple[X, ...]` (a list), a tuple of pairs
`tuple[tuple[str, X], ...]` (a mapping), an `enum.Enum` (its value), bool, int, float (an int
is taken), str. Any other type is a programming error (TypeError), which the round trip of the
default tree in the tests finds.

Values are checked as they are read: an unknown key, a value of the wrong type, and a
dataclass's own validation (`__post_init__` raising ValueError or TypeError) are each a
`ConfigError` naming the dotted key path (`workers.engine.block_size`,
`router.admission.tenant_limits[0].tokens_per_s`).

Paths in `skip` are not part of the data (pdserve fills them in itself): `to_data` leaves
them out and `from_data` refuses them.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

NO_SKIP: frozenset[str] = frozenset()


class ConfigError(ValueError):
    """A value that does not fit its field; `path` is its dotted key path ("" for the root)."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.path = path
        self.problem = problem


def from_data(
    cls: type[T], data: Any, default: T | None = None, skip: frozenset[str] = NO_SKIP
) -> T:
    """The tree of type `cls` that `data` describes; what it leaves out is `default`'s (or
    the fields' defaults when None)."""
    tree: T = _read(cls, data, default, skip, "")
    return tree


def to_data(tree: Any, skip: frozenset[str] = NO_SKIP) -> Any:
    """`tree` as plain data (dicts, lists, str, numbers, bools, None) for `from_data`."""
    return _write(type(tree), tree, skip, "")


def type_at(cls: type, path: str) -> Any:
    """The declared type of the field at dotted `path` under dataclass `cls` (`X | None`
    without the None)."""
    tp: Any = cls
    for name in path.split("."):
        tp = dict(_fields(_optional(tp)))[name]
    return _optional(tp)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, resolved type) of each field `cls.__init__` takes."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def _optional(tp: Any) -> Any:
    """X for `X | None`; `tp` itself for anything else."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported union {tp}: only X | None")
        return rest[0]
    return tp


def _pair_value_type(tp: Any) -> Any | None:
    """X when `tp` is `tuple[tuple[str, X], ...]` (written as a mapping), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is not tuple or len(args) != 2 or args[1] is not Ellipsis:
        return None
    item = args[0]
    item_args = typing.get_args(item)
    if typing.get_origin(item) is tuple and len(item_args) == 2 and item_args[0] is str:
        return item_args[1]
    return None


def _suggestion(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _read(tp: Any, value: Any, default: Any, skip: frozenset[str], path: str) -> Any:
    inner = _optional(tp)
    if inner is not tp:
        return None if value is None else _read(inner, value, default, skip, path)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _read_dataclass(tp, {} if value is None else value, default, skip, path)
    pair_type = _pair_value_type(tp)
    if pair_type is not None:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        return tuple(
            (_read(str, k, None, skip, path), _read(pair_type, v, None, skip, _join(path, k)))
            for k, v in value.items()
        )
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {value!r}")
        return tuple(_read(args[0], v, None, skip, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        for member in tp:
            if member.value == value:
                return member
        choices = ", ".join(str(m.value) for m in tp)
        raise ConfigError(path, f"expected one of {choices}, got {value!r}")
    return _read_scalar(tp, value, path)


def _read_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected a whole number, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported field type {tp!r}")


def _read_dataclass(cls: type, value: Any, default: Any, skip: frozenset[str], path: str) -> Any:
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"expected a mapping, got {value!r}")
    known = dict(_fields(cls))
    for key in value:
        if key not in known:
            raise ConfigError(_join(path, key), "unknown key" + _suggestion(str(key), [*known]))
        if _join(path, key) in skip:
            raise ConfigError(_join(path, key), "filled in by pdserve, not read from a file")
    changes = {
        name: _read(tp, value[name], getattr(default, name, None), skip, _join(path, name))
        for name, tp in known.items()
        if name in value
    }
    if default is None:
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.init and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]  # fmt: skip
        missing = [name for name in required if name not in changes]
        if missing:
            raise ConfigError(_join(path, missing[0]), "missing (it has no default)")
    try:
        return dataclasses.replace(default, **changes) if default is not None else cls(**changes)
    except (ValueError, TypeError) as e:  # the dataclass's own validation
        # "field: problem" names one field: the error's path goes down to it (so a flag that
        # set it is what the refusal names)
        field, sep, problem = str(e).partition(": ")
        if sep and field in {f.name for f in dataclasses.fields(cls)}:
            raise ConfigError(_join(path, field), problem) from e
        raise ConfigError(path, str(e)) from e


def _write(tp: Any, value: Any, skip: frozenset[str], path: str) -> Any:
    if value is None:
        return None
    tp = _optional(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return {
            name: _write(field_type, getattr(value, name), skip, _join(path, name))
            for name, field_type in _fields(tp)
            if _join(path, name) not in skip
        }
    pair_type = _pair_value_type(tp)
    if pair_type is not None:
        return {k: _write(pair_type, v, skip, _join(path, k)) for k, v in value}
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return [_write(args[0], v, skip, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return value.value
    if tp is float:
        return float(value)
    if tp in (bool, int, str):
        return value
    raise TypeError(f"{path}: unsupported field type {tp!r}")
