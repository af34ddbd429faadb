"""Configuration: TOML files and ``--section.field value`` overrides read into the dataclass
sections of :mod:`zerotron.config_sections` (:func:`load_config`).

Every problem raises :class:`ConfigError` with one message that names the field and the fix. Values
and combinations are checked in one place, :func:`zerotron.plan.build_plan`.
"""
from __future__ import annotations

import difflib
import functools
import sys
from pathlib import Path

from .config_sections import SECTIONS, Config, ModelConfig
from .fields import field_defaults, field_types

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration value, file or combination; the message names the field and the fix."""


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _default(section: str, name: str):
    """The default value of config field ``section.name``."""
    return field_defaults(SECTIONS[section])[name]


def _coerce(section: str, name: str, typ, value, from_cli: bool = False):
    """Convert ``value`` to ``typ`` or raise ConfigError. CLI strings are parsed (an int field takes
    an integer literal: "1e3" and "1.0" are refused, as the floats they are in a TOML file); TOML
    values must already have the right type (an int is accepted for a float). Ranges are checked
    later (``config_checks.check_values``: every int within 64 bits, then each field's own bounds)."""
    key = f"{section}.{name}"
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ) if isinstance(typ, str) else typ
    if from_cli and isinstance(value, str) and typ is not str:
        s = value.strip()
        if typ is bool:
            if s.lower() in ("true", "1", "yes", "on"):
                return True
            if s.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        try:
            # an int field takes an integer literal only, as in a TOML file (where 1e3 is a float and
            # refused): "1e20" was read as int(1e20) and "1e3" as 1000
            return typ(s)
        except ValueError:
            hint = f" (an integer in digits, e.g. --{key} {_default(section, name)})" if typ is int else ""
            raise ConfigError(f"{key} must be {typ.__name__}, got {value!r}{hint}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        hint = f" (an integer in digits, e.g. {name} = {_default(section, name)})" if typ is int and \
            isinstance(value, float) else ""
        raise ConfigError(f"{key} must be {typ.__name__}, got {type(value).__name__} {value!r}{hint}")
    return value


def apply(cfg: Config, section: str, name: str, value, from_cli: bool = False) -> None:
    """Set ``cfg.<section>.<name> = value`` with type checking; ConfigError for unknown keys."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}{_suggest(section, SECTIONS)}; "
                          f"valid sections: {', '.join(SECTIONS)}")
    types = field_types(SECTIONS[section])
    if name not in types:
        raise ConfigError(f"unknown config key {section}.{name}{_suggest(name, types)}; "
                          f"valid keys in [{section}]: {', '.join(types)}")
    obj = getattr(cfg, section)
    setattr(obj, name, _coerce(section, name, types[name], value, from_cli))
    obj.__dict__.setdefault("_given", set()).add(name)  # ModelConfig.given: set, even to the default


def _parse_toml(text: str) -> dict:
    """``tomllib.loads(text)``, a fresh copy each call, the parse cached by text (tests and the
    parity matrix build tens of thousands of configs from one file). Raises TOMLDecodeError."""
    return _fresh_copy(_parse_toml_cached(text))


def _fresh_copy(value):
    """A copy of parsed TOML: its tables (dicts) and arrays (lists) copied, at every depth, the
    immutable leaves (str, int, float, bool, dates and times) shared -- what ``copy.deepcopy``
    gives for this data, at a fraction of its cost."""
    if isinstance(value, dict):
        return {k: _fresh_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh_copy(v) for v in value]
    return value


@functools.lru_cache(maxsize=16)
def _parse_toml_cached(text: str) -> dict:
    return tomllib.loads(text)


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    """Build a Config from defaults, then a TOML file, then ``(dotted_key, value)`` overrides.

    Raises ConfigError for a missing/unparsable file, unknown sections/keys, wrong types."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "not found"
            raise ConfigError(f"config file {str(p)!r} {what}; pass an existing TOML file to --config "
                              "(see configs/ for examples)")
        try:
            data = _parse_toml(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:  # TOML is UTF-8 (before: a traceback)
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}); pass a TOML file "
                              "saved as UTF-8 to --config") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {str(p)!r}: top-level key {section!r} must be a [section] table; "
                                  f"valid sections: {', '.join(SECTIONS)}")
            for name, value in values.items():
                apply(cfg, section, name, value)
    for key, value in overrides or []:
        if key.count(".") != 1:
            raise ConfigError(f"override --{key} must look like --section.field (e.g. --train.steps 10)")
        section, name = key.split(".")
        apply(cfg, section, name, value, from_cli=isinstance(value, str))
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``["--train.steps", "10", "--log.progress=false"]`` into ``[("train.steps", "10"), ...]``.

    Raises ConfigError for an argument that is not ``--section.field`` or lacks a value."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {a!r}; config overrides look like --section.field VALUE")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a} needs a value (e.g. {a} 10)")
            k, v = a[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def model_shape(m: ModelConfig) -> dict:
    """Resolve the model family and sizes: set fields, then the preset, then the defaults (see
    :func:`zerotron.models.registry.resolve_shape`). Returns ``{"arch", "n_layer", "n_head",
    "n_embd", "block_size", "bias"}`` (+ ``vocab_size`` if the preset fixes one, + the llama fields).
    Raises ValueError (one line naming the field) for an unknown arch or preset or a field the
    family lacks."""
    from .models.registry import resolve_shape

    return resolve_shape(m)
