"""`key=value` overrides of a frozen dataclass config, shared by every training command.

The CLI hands over strings; each value is converted to the field's declared type (from the dataclass
annotations, not the default value, so `hidden_size: int | None = None` still takes `hidden_size=256`).
Anything ambiguous is refused with a message naming the key, rather than guessed: a silently misread
override costs a whole training run.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass, replace
from typing import Any, TypeVar

C = TypeVar("C")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_overrides(items: Sequence[str]) -> dict[str, str]:
    """`["steps=100", "lr=1e-3"]` -> `{"steps": "100", "lr": "1e-3"}`; a later repeat of a key wins."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"setting {item!r} is not of the form key=value (e.g. steps=100)")
        out[key.strip()] = value.strip()
    return out


def with_overrides(cfg: C, overrides: dict[str, str]) -> C:
    """A copy of the dataclass `cfg` with `overrides` applied, each converted to its field's type.

    Supported field types: bool, int, float, str, tuples of ints or floats (comma-separated:
    `target_layer_ids=1,3,4`, `confidence_temperatures=0,0.5,1`), and `X | None` of those (the value `none` gives
    None). Other tuple-valued fields (e.g. domain weights) cannot be set this way and say so.
    """
    if not is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"with_overrides expects a dataclass instance, got {type(cfg).__name__}")
    hints = typing.get_type_hints(type(cfg))
    valid = {f.name for f in fields(cfg)}
    kwargs: dict[str, Any] = {}
    for key, raw in overrides.items():
        if key not in valid:
            raise ValueError(f"unknown setting {key!r}; valid keys: {', '.join(sorted(valid))}")
        kwargs[key] = _convert(key, raw, hints[key])
    return replace(cfg, **kwargs)


def _convert(key: str, raw: str, annotation: Any) -> Any:
    is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    options = typing.get_args(annotation) if is_union else (annotation,)
    optional = type(None) in options
    options = tuple(t for t in options if t is not type(None))
    if optional and raw.lower() in ("none", "null"):
        return None
    if len(options) == 1 and _is_number_tuple(options[0]):
        return _number_tuple(key, raw, options[0])
    if len(options) != 1 or options[0] not in (bool, int, float, str):
        raise ValueError(f"setting {key!r} ({_type_name(annotation)}) cannot be set with key=value; "
                         "edit the preset instead")
    kind = options[0]
    if kind is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"setting {key}={raw!r}: expected true or false")
    try:
        return kind(raw)
    except ValueError:
        expected = {int: "an integer", float: "a number"}.get(kind, kind.__name__) + (" or none" if optional else "")
        raise ValueError(f"setting {key}={raw!r}: expected {expected}") from None


def _is_number_tuple(annotation: Any) -> bool:
    """tuple[int, ...], tuple[float, ...] or a fixed-size tuple of one of them."""
    args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
    return typing.get_origin(annotation) is tuple and bool(args) and len(set(args)) == 1 and args[0] in (int, float)


def _number_tuple(key: str, raw: str, annotation: Any) -> tuple[int | float, ...]:
    """`1,3,4` -> (1, 3, 4) (`0,0.5` -> (0.0, 0.5) for floats), checking the length of a fixed-size tuple."""
    args = typing.get_args(annotation)
    kind = args[0]
    noun = "integers, e.g. 1,3,4" if kind is int else "numbers, e.g. 0,0.5,1"
    try:
        value = tuple(kind(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"setting {key}={raw!r}: expected comma-separated {noun}") from None
    if Ellipsis not in args and len(value) != len(args):
        raise ValueError(f"setting {key}={raw!r}: expected {len(args)} comma-separated {noun.partition(',')[0]}")
    return value


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)
