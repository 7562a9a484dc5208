"""YAML + ``key=value`` overrides, validated into typed, frozen dataclasses.

The way MaxDiffusion users type it::

    difforge train configs/stages/train.yml learning_rate=1e-4 mesh.ici_fsdp_parallelism=4

- Dotted keys address nested sections (``mesh.ici_fsdp_parallelism=4``).
- A bare key that is not a top-level field but names exactly one leaf in a nested section is
  accepted (``ici_fsdp_parallelism=4``), as MaxDiffusion's flat configs are; an ambiguous one is
  an error listing the candidates.
- Values are parsed as YAML scalars/lists (``1`` int, ``1e-5`` float, ``true``, ``[1,2]``, ``null``).
- Unknown keys, wrong types and missing required values raise :class:`ConfigError` naming the
  key (with the closest valid key as a suggestion).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A user error in a config file or override; the message names the key."""


def _suggest(key: str, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert ``value`` to type ``tp``; errors name ``key``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {tp}"
        )
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{key}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a section (mapping), got {value!r}")
        return from_dict(tp, value, prefix=f"{key}.")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{key}: expected {len(args)} items, got {len(value)}")
            items = [
                _coerce(v, a, f"{key}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            ]
        else:
            item_tp = args[0] if args else Any
            items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)  # YAML 1.1 reads "1e-5" as a string
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if not math.isfinite(number):  # YAML's .nan / .inf: no setting means either
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def from_dict[T](cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, recursively, with named errors."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise ConfigError(f"unknown key {prefix}{key}{_suggest(str(key), list(fields))}")
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            value = data[name]
            factory = field.default_factory
            if isinstance(value, Mapping) and factory not in (dataclasses.MISSING, hints[name]):
                # a section whose default is not its class's own (e.g. bf16 compute for TPU):
                # the given keys change that default, they do not start from the class's
                default = factory()
                if dataclasses.is_dataclass(default):
                    value = _merged(to_dict(default), value)
            kwargs[name] = _coerce(value, hints[name], f"{prefix}{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required value {prefix}{name}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {err}") from None


def _merged(base: Mapping, given: Mapping) -> dict:
    """``given`` over ``base``, nested mappings merged key by key."""
    out = dict(base)
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            value = _merged(out[key], value)
        out[key] = value
    return out


def to_dict(cfg: Any) -> Any:
    """Plain YAML/JSON-able data (tuples become lists)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, Mapping):
        return {str(k): to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; a missing file or malformed YAML is a ConfigError naming it."""
    from jaxcore import storage

    try:
        text = storage.read_text(str(path))
    except (storage.StorageError, FileNotFoundError):
        raise ConfigError(f"config file {path} does not exist") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _leaf_paths(cls: type, prefix: tuple[str, ...] = ()) -> dict[str, list[tuple[str, ...]]]:
    """leaf name -> every dotted path where it appears inside nested dataclass sections."""
    out: dict[str, list[tuple[str, ...]]] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [a for a in (get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp) or inner:
            sub = tp if dataclasses.is_dataclass(tp) else inner[0]
            for leaf, paths in _leaf_paths(sub, (*prefix, f.name)).items():
                out.setdefault(leaf, []).extend(paths)
        else:
            out.setdefault(f.name, []).append((*prefix, f.name))
    return out


def _all_dotted(cls: type) -> list[str]:
    return [".".join(p) for paths in _leaf_paths(cls).values() for p in paths]


def parse_override(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def resolve_key(cls: type, key: str) -> tuple[str, ...]:
    """Map an override key (dotted, or a bare leaf name) to its path in ``cls``."""
    parts = tuple(key.split("."))
    top = {f.name for f in dataclasses.fields(cls)}
    if parts[0] in top:
        return parts
    if len(parts) == 1:
        candidates = _leaf_paths(cls).get(key, [])
        if len(candidates) == 1:
            return candidates[0]
        if len(candidates) > 1:
            names = ", ".join(".".join(c) for c in candidates)
            raise ConfigError(f"key {key!r} is ambiguous: write one of {names}")
    raise ConfigError(f"unknown key {key}{_suggest(key, [*top, *_all_dotted(cls)])}")


def apply_values(cls: type, data: dict, values: Mapping[str, Any]) -> dict:
    """Set already-parsed values by (dotted or bare) key; returns a new dict."""
    data = _deep_copy(data)
    for key, value in values.items():
        path = resolve_key(cls, key)
        node = data
        for p in path[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"{key}: {p} is not a section")
            node = child
        node[path[-1]] = _deep_copy(value)
    return data


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def load_config[T](
    cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()
) -> T:
    """YAML file (optional) + overrides -> validated ``cls``.

    A config class, or the class of any nested section, may define
    ``implied_by_overrides(given, current) -> {path: value}`` (paths relative to its section;
    ``current``: the section's values before the overrides, defaults filled in): values the
    command line implies for keys it did not set (e.g. a model source given there clears the
    YAML's other sources); they replace the YAML's before the overrides apply."""
    data = read_yaml(path) if path else {}
    values = dict(parse_override(text) for text in overrides)
    given = {tuple(resolve_key(cls, key)): value for key, value in values.items()}
    implied: dict[tuple[str, ...], Any] = {}
    for section, section_cls in _sections(cls):
        implied_by = getattr(section_cls, "implied_by_overrides", None)
        if implied_by is None:
            continue
        depth = len(section)
        mine = {p[depth:]: v for p, v in given.items() if p[:depth] == section and p[depth:]}
        current = _section_values(section_cls, data, section)
        implied.update({(*section, *p): v for p, v in implied_by(mine, current).items()})
    if implied:
        data = apply_values(cls, data, {".".join(p): v for p, v in implied.items()})
    data = apply_values(cls, data, values)
    return from_dict(cls, data)


def _sections(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], type]]:
    """``cls`` and every nested dataclass section, with their paths."""
    out = [(prefix, cls)]
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _sections(tp, (*prefix, f.name))
    return out


def _section_values(cls: type, data: Mapping, section: tuple[str, ...]) -> dict:
    """A section's values as the YAML gives them, its defaults filled in (leaf fields only)."""
    raw: Any = data
    for name in section:
        raw = raw.get(name) if isinstance(raw, Mapping) else None
    raw = raw if isinstance(raw, Mapping) else {}
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            out[f.name] = raw[f.name]
        elif f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


def config_json_kwargs(
    cls: type, raw: Mapping[str, Any], error: type[Exception], ignored: Sequence[str] = ()
) -> dict[str, Any]:
    """Keyword arguments of dataclass ``cls`` from a diffusers/transformers ``config.json``.

    Keys starting with ``_`` (``_class_name``, ``_diffusers_version``) and ``ignored`` are
    skipped; any other key the dataclass lacks raises ``error`` naming it, so an unsupported
    variant is refused instead of silently dropped.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in raw.items() if not k.startswith("_") and k not in ignored}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise error(f"unknown {cls.__name__} keys {unknown}; known keys: {sorted(known)}")
    return kwargs
