"""Dataclass field bookkeeping shared by the config sections and the model registry (no dependencies,
so both may import it without a cycle)."""

from __future__ import annotations

import dataclasses
import functools


@functools.cache
def field_defaults(cls) -> dict:
    """{field name: default} of dataclass ``cls`` (``dataclasses.MISSING`` for a field without one),
    cached: ``ModelConfig.given`` asks it millions of times when the parity matrix validates its
    44,240 layouts. Raises TypeError when ``cls`` is not a dataclass."""
    return {f.name: f.default for f in dataclasses.fields(cls)}
