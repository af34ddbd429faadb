"""Dataclass field bookkeeping shared by the config sections and the model registry (no dependencies,
so both may import it without a cycle)."""

from __future__ import annotations

import dataclasses
import functools
import typing


@functools.cache
def field_defaults(cls) -> dict:
    """{field name: default} of dataclass ``cls`` (``dataclasses.MISSING`` for a field without one),
    cached: ``ModelConfig.given`` asks it millions of times when the parity matrix validates its
    44,240 layouts. Raises TypeError when ``cls`` is not a dataclass."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


@functools.cache
def field_types(cls) -> dict:
    """{field name: type} of dataclass ``cls``, its string annotations resolved (cached: resolving
    them is the slow part of loading a config). Raises TypeError when ``cls`` is not a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}
