"""Documentation of every config field, read from :mod:`zerotron.config_sections` itself.

Each field of a config dataclass is followed by its *attribute docstring* (a string literal on the
next line, the convention Sphinx autodoc reads). :func:`config_fields` collects name, type and
default from ``dataclasses.fields`` and the meaning from those literals (``ast`` over the class
source), so ``zerotron train --help`` cannot drift from the code: a new field without a docstring
shows ``(undocumented)`` and fails ``tests/test_cli_help.py``.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing


def attribute_docs(cls) -> dict[str, str]:
    """``{field name: docstring}`` of the string literals that follow annotated assignments in the
    body of class ``cls`` (whitespace collapsed). Fields without one are absent."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def _type_name(t) -> str:
    return t.__name__ if isinstance(t, type) else str(t)


def config_fields() -> list[dict]:
    """One dict per config field, in declaration order: ``key`` ("section.field"), ``type``
    ("int", "str", ...), ``default`` (the dataclass default) and ``doc`` (its attribute docstring,
    "" when missing)."""
    from .config_sections import SECTIONS

    rows = []
    for sec, cls in SECTIONS.items():
        hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
        for f in dataclasses.fields(cls):
            rows.append({"key": f"{sec}.{f.name}", "type": _type_name(hints[f.name]), "default": f.default,
                         "doc": docs.get(f.name, "")})
    return rows


def _fmt_default(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()  # as on the command line / in TOML
    return repr(v) if isinstance(v, str) else str(v)


def fields_help(width: int = 100) -> str:
    """The "config fields" section of ``zerotron train --help``: one entry per field,
    ``--section.field TYPE (default: X)`` and its meaning, grouped by section."""
    lines, section = ["config fields (set in the TOML file as [section] field = value, or here as "
                      "--section.field VALUE):"], None
    for r in config_fields():
        sec = r["key"].split(".")[0]
        if sec != section:
            section = sec
            lines.append(f"\n  [{sec}]")
        lines.append(f"  --{r['key']} {r['type'].upper()} (default: {_fmt_default(r['default'])})")
        lines.extend(textwrap.wrap(r["doc"] or "(undocumented)", width, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6, break_on_hyphens=False))  # ZeRO-Infinity stays whole
    return "\n".join(lines)
