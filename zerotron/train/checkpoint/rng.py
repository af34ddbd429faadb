"""RNG states of one process, as a checkpoint saves them in ``rng/rank_<r>.pt``."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    """RNG states of this process (torch CPU, CUDA if present, numpy, python)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the RNG states :func:`rng_state` returned (CUDA only where it was saved and is present)."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

