"""How a configuration field is declared and checked: one annotation, one-line errors.

A node's settings arrive from a TOML file, the environment, command-line flags and, when the
broker is embedded, Python code.  Hand-written checks in each path drifted apart (a string
where a number belongs crashed deep inside the broker; ``allow_anonymous = "no"`` let
everybody in), so every field of a settings dataclass declares its type and range once, as
its annotation, and every path goes through the same check::

    max_inflight: Annotated[int, Meta(ge=1, le=65535)] = 32

``msgspec.convert(..., strict=True)`` does the type and range check (it refuses ``"32"`` for
an ``int`` and ``true`` for an ``int``, accepts ``1`` for a ``float``).  What msgspec cannot
express is added as more ``Annotated`` metadata from this module: a ``Rule`` (a function,
such as a HOST:PORT or topic filter check, and the words for what it allows), ``OFF`` (``""``
or ``false`` turn the setting off, i.e. ``None``) and ``SECRET`` (the value is never echoed
in an error).  Settings tables (``[limits]``) are dataclass fields whose type is another
settings dataclass with a ``TABLE`` class variable naming its table.

``check_fields`` runs in ``__post_init__``, so a dataclass built directly, by
``dataclasses.replace`` or from a file is checked the same way; it also normalises what it
may (``"data"`` to ``Path("data")``, a list to a tuple).  ``parse_text`` turns the string of
an environment variable or a flag into the field's type (msgspec's lax mode: ``"32"`` is an
integer there, ``"true"``/``"false"``/``"1"``/``"0"`` are booleans; lists and tables are TOML
values) and then runs the same check.

Every error is a ``ConfigError`` of one line: ``KEY = VALUE: expected WHAT``, where KEY is
the table-qualified key (``limits.max_inflight``), the environment variable or the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal

import msgspec

__all__ = ["OFF", "SECRET", "ConfigError", "FieldSpec", "Invalid", "Rule", "build",
           "check_fields", "check_value", "error", "field_specs", "parse_text",
           "positive_seconds", "show", "suggest", "table_values"]


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range (one line)."""


class Invalid(ValueError):
    """Raised by a ``Rule`` check: what is wrong, optionally about one part of the value.

    ``part`` names the part (``"alice"`` in ``users``, an index in a list): the error is then
    reported as ``users.alice = ...``.
    """

    def __init__(self, reason: str, *, part: str | None = None, value: Any = None,
                 secret: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.part = part
        self.value = value
        self.secret = secret


@dataclass(frozen=True, slots=True)
class Rule:
    """A check msgspec cannot express, run after the type and range check.

    ``check`` gets the converted value and returns the value to keep (normalised); it raises
    ``ValueError`` (then the error says ``expected <allowed>``) or ``Invalid`` (its reason).
    """

    check: Callable[[Any], Any]
    allowed: str


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: ``""`` or ``false`` mean "off" (``None``): a listener that is not wanted.
OFF = _Marker("OFF")
#: Never echo the value in an error (a secret, a password digest).
SECRET = _Marker("SECRET")


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """What ``check_value`` needs to know about one field, derived from its annotation."""

    name: str
    #: The annotation with this module's markers removed: what msgspec converts to.
    type: Any
    rules: tuple[Rule, ...]
    off: bool
    secret: bool
    #: A settings table (a dataclass with ``TABLE``), or None for a plain value.
    table: type | None
    #: Words for what is allowed, for error messages.
    allowed: str

    @property
    def structured(self) -> bool:
        """A list or table value: from text it is written as a TOML value."""
        return _origin(self.type) in (tuple, list, dict)


@cache
def field_specs(cls: type) -> dict[str, FieldSpec]:
    """The fields of a settings dataclass, in declaration order (cached per class)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: _spec(f.name, hints[f.name]) for f in dataclasses.fields(cls)}


def _spec(name: str, annotation: Any) -> FieldSpec:
    rules: list[Rule] = []
    off = secret = False
    base = annotation
    metas: list[msgspec.Meta] = []
    if typing.get_origin(annotation) is Annotated:
        base, *extras = typing.get_args(annotation)
        for extra in extras:
            if isinstance(extra, Rule):
                rules.append(extra)
            elif extra is OFF:
                off = True
            elif extra is SECRET:
                secret = True
            elif isinstance(extra, msgspec.Meta):
                metas.append(extra)
            else:
                raise TypeError(f"{name}: unknown annotation {extra!r}")
    plain = _without_none(base)
    table = plain if isinstance(plain, type) and hasattr(plain, "TABLE") else None
    msgspec_type = Annotated[(base, *metas)] if metas else base  # type: ignore[valid-type]
    allowed = rules[-1].allowed if rules else _describe(msgspec_type)
    if off:
        allowed += ', or "" / false to turn it off'
    return FieldSpec(name, msgspec_type, tuple(rules), off, secret, table, allowed)


def _origin(tp: Any) -> Any:
    tp = _without_none(tp)
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return typing.get_origin(tp) or tp


def _without_none(tp: Any) -> Any:
    """``X | None`` -> ``X`` (the types here have at most one other arm)."""
    if isinstance(tp, UnionType) or typing.get_origin(tp) is typing.Union:
        arms = [a for a in typing.get_args(tp) if a is not NoneType]
        if len(arms) == 1:
            return arms[0]
    return tp


def _describe(tp: Any) -> str:
    """Words for a type and its msgspec constraints: ``an integer in 1..65535``."""
    tp = _without_none(tp)
    meta: dict[str, Any] = {}
    if typing.get_origin(tp) is Annotated:
        tp, *extras = typing.get_args(tp)
        for extra in extras:
            if isinstance(extra, msgspec.Meta):
                meta.update({k: getattr(extra, k) for k in ("ge", "gt", "le", "lt",
                                                            "min_length", "pattern")
                             if getattr(extra, k) is not None})
    if tp is bool:
        return "true or false"
    if tp in (int, float):
        noun = "an integer" if tp is int else "a finite number"
        if "ge" in meta and "le" in meta:
            return f"{noun} in {meta['ge']}..{meta['le']}"
        bounds = [f"{op} {meta[key]}" for key, op in
                  (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if key in meta]
        return f"{noun} {' and '.join(bounds)}" if bounds else noun
    if tp is str:
        return "a non-empty string" if meta.get("min_length") else "a string"
    if tp is Path:
        return "a path (a string)"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(show(choice) for choice in typing.get_args(tp))
    if origin in (tuple, list):
        return "a list"
    if origin is dict:
        return "a table"
    return getattr(tp, "__name__", str(tp))


def _dec_hook(tp: type, value: Any) -> Any:
    """msgspec knows no ``Path``: keep one, make one from a non-empty string."""
    if tp is Path:
        if isinstance(value, Path):
            return value
        if isinstance(value, str) and value:
            return Path(value)
    raise TypeError(f"expected {tp.__name__}")


def show(value: Any) -> str:
    """A value as the operator wrote it (TOML-like): ``"32"``, ``8080``, ``false``."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else f"{'-' if value < 0 else ''}inf"  # not JSON's
    try:
        return json.dumps(value, ensure_ascii=False, default=_jsonable)
    except (TypeError, ValueError):
        return repr(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | frozenset | set):
        return list(value)
    return repr(value)


def error(label: str, value: Any, expected: str, *, secret: bool = False) -> ConfigError:
    """``label = value: expected ...`` as a ``ConfigError`` (the value hidden if secret)."""
    shown = "(hidden)" if secret else show(value)
    return ConfigError(f"{label} = {shown}: {expected}")


def suggest(name: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the closest known name, or nothing."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def check_value(spec: FieldSpec, value: Any, label: str) -> Any:
    """The value converted to the field's type and checked; ``ConfigError`` names ``label``."""
    if spec.off and (value is False or value == ""):
        return None
    if spec.table is not None:
        if isinstance(value, spec.table):
            return value
        if isinstance(value, Mapping):
            return build(spec.table, table_values(spec.table, value, label))
        raise error(label, value, f"expected a table ([{label}])")
    try:
        converted = msgspec.convert(value, spec.type, strict=True, dec_hook=_dec_hook)
    except msgspec.ValidationError:
        raise error(label, value, f"expected {spec.allowed}", secret=spec.secret) from None
    if converted is None:
        return None
    _check_finite(spec, converted, value, label)
    for rule in spec.rules:
        try:
            converted = rule.check(converted)
        except Invalid as exc:
            if exc.part is None:
                raise error(label, value, exc.reason, secret=spec.secret) from None
            raise error(f"{label}.{exc.part}", exc.value, exc.reason,
                        secret=spec.secret or exc.secret) from None
        except ValueError:
            allowed = spec.allowed if rule is spec.rules[-1] else rule.allowed
            raise error(label, value, f"expected {allowed}", secret=spec.secret) from None
    return converted


def _check_finite(spec: FieldSpec, converted: Any, value: Any, label: str) -> None:
    """Refuse inf and nan for a number (``value``: as written, for the error).

    TOML and msgspec's float both take them (nan fails a range check, inf passes every
    lower bound): an infinite timeout or interval is never what a setting means (0 turns
    off what can be turned off), and the broker's arithmetic on them assumes finite numbers
    (``fence_seconds``: inf - inf is nan).
    """
    if isinstance(converted, float) and not math.isfinite(converted):
        raise error(label, value, f"expected {spec.allowed}", secret=spec.secret)


def parse_text(spec: FieldSpec, text: str, label: str) -> Any:
    """An environment variable's or a flag's string, as the field's type, checked."""
    if spec.off and text.strip().lower() in ("", "false"):
        return None
    if spec.table is not None:
        raise error(label, text, "expected a table: set its keys one by one")
    if spec.structured:
        try:
            value: Any = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            raise error(label, text, f"expected {spec.allowed}, written as a TOML value "
                        '(e.g. ["a/#", "b/+"] or {key = "value"})',
                        secret=spec.secret) from None
        return check_value(spec, value, label)
    try:
        value = msgspec.convert(text, spec.type, strict=False, dec_hook=_dec_hook)
    except msgspec.ValidationError:
        raise error(label, text, f"expected {spec.allowed}", secret=spec.secret) from None
    _check_finite(spec, value, text, label)
    return check_value(spec, value, label)


def check_fields(obj: Any) -> None:
    """Check (and normalise in place) every field of a frozen settings dataclass.

    Called from ``__post_init__``: the object is not yet visible to anyone, so replacing a
    field with its normalised value (``Path`` for ``str``) is still construction.
    """
    table = getattr(type(obj), "TABLE", "")
    for name, spec in field_specs(type(obj)).items():
        value = getattr(obj, name)
        checked = check_value(spec, value, f"{table}.{name}" if table else name)
        if checked is not value:
            object.__setattr__(obj, name, checked)


def table_values(cls: type, raw: Mapping[str, Any], label: str = "") -> dict[str, Any]:
    """A TOML table's keys, each checked and named under ``label``; unknown keys refused.

    Returns plain values, and a dict of the same kind for each settings table, so that
    layers (file, environment, flags) can be merged key by key before ``build``.
    """
    specs = field_specs(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        where = f"{label}.{key}" if label else key
        if name not in specs:
            near = suggest(name, specs)
            if near and label:
                near = near.replace("mean ", f"mean {label}.")
            raise error(where, value, f"unknown setting{near}", secret=_looks_secret(name))
        spec = specs[name]
        if spec.table is not None and isinstance(value, Mapping):
            values[name] = table_values(spec.table, value, where)
        else:
            values[name] = check_value(spec, value, where)
    return values


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """A settings dataclass from checked values (nested dicts become their tables)."""
    specs = field_specs(cls)
    kwargs = {name: build(specs[name].table, value)  # type: ignore[arg-type]
              if specs[name].table is not None and isinstance(value, Mapping) else value
              for name, value in values.items()}
    return cls(**kwargs)


def _looks_secret(name: str) -> bool:
    return any(word in name for word in ("secret", "password", "token"))


def positive_seconds(text: str) -> float:
    """argparse ``type=`` for a command's ``--timeout``: a finite number of seconds > 0.

    ``type=float`` took ``nan`` and ``-1`` (trio then raised ValueError from inside the
    call: a traceback) and ``inf`` (a command that never gives up on a node that does not
    answer), as settings did before they were held to being finite.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number of seconds > 0")
    return value
