"""Deterministic global-batch sampler: which windows step k trains on.

The stream of window indices is the concatenation, epoch after epoch, of random
permutations of ``range(num_windows)``; epoch e's permutation comes from a numpy
Generator seeded by ``(seed, e)``. Step k takes stream positions
``[k*G, (k+1)*G)``. So the global batch is a pure function of (seed, step): it
never depends on the data-parallel degree, and a restarted run resumes at any step
with no sampler state. A batch may straddle two epochs; no window is dropped or
repeated within an epoch. Data-parallel rank r of D takes the contiguous slice
``[r*G/D, (r+1)*G/D)`` of the global batch.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .corpus import DataError


def _check_int(name: str, value, low: int) -> int:
    """Return ``value`` as int; ValueError unless it is an integer >= low."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class GlobalBatchSampler:
    """Deterministic, dp-invariant, stateless sampler of training windows.

    Args:
        num_windows: windows in the train split (int >= 1; see ``num_windows()``).
        global_batch: G, windows per optimizer step across all dp ranks (int >= 1).
        seed: non-negative int.
    Raises:
        DataError: num_windows < 1 (the split is too small for one window).
        ValueError: global_batch < 1 or seed < 0 or non-integers.
    """

    CACHED_EPOCHS = 2  # a batch spans at most two epochs when G <= num_windows

    def __init__(self, num_windows: int, global_batch: int, seed: int):
        if isinstance(num_windows, (int, np.integer)) and not isinstance(num_windows, bool) \
                and num_windows < 1:
            raise DataError("the train split has no window of the chosen seq_len; "
                            "lower model.block_size (the sequence length) or use a larger corpus")
        self.num_windows = _check_int("num_windows", num_windows, 1)
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.seed = _check_int("seed", seed, 0)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of windows: int64 (num_windows,), read-only (cached)."""
        perm = self._perms.get(epoch)
        if perm is None:
            rng = np.random.default_rng([self.seed, epoch])
            perm = rng.permutation(self.num_windows).astype(np.int64)
            perm.flags.writeable = False
            self._perms[epoch] = perm
            while len(self._perms) > self.CACHED_EPOCHS:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def global_indices(self, step: int) -> np.ndarray:
        """Window indices of the whole global batch of ``step``.

        Args:
            step: optimizer step, int >= 0.
        Returns:
            int64 array (global_batch,), stream positions ``[step*G, (step+1)*G)``.
        Raises:
            ValueError: step is not a non-negative int.
        """
        step = _check_int("step", step, 0)
        n, g = self.num_windows, self.global_batch
        start, stop = step * g, (step + 1) * g
        # one array of G, filled epoch by epoch: a list of per-epoch views kept every permutation alive,
        # so a global batch of 10**12 windows grew until the OOM killer came; now numpy's MemoryError at once
        out = np.empty(g, dtype=np.int64)  # always a fresh, writable array
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, n)
            take = min(n - offset, stop - pos)
            out[pos - start:pos - start + take] = self.permutation(epoch)[offset:offset + take]
            pos += take
        return out

    def local_indices(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """This data-parallel rank's share of ``global_indices(step)``.

        Returns:
            int64 array (global_batch // dp_size,): slice ``[r*G/D, (r+1)*G/D)``.
        Raises:
            ValueError: dp_size < 1, dp_rank outside [0, dp_size), or
                global_batch not divisible by dp_size.
        """
        dp_size = _check_int("dp_size", dp_size, 1)
        dp_rank = _check_int("dp_rank", dp_rank, 0)
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be < dp_size {dp_size}")
        if self.global_batch % dp_size:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by dp degree "
                             f"{dp_size}; pick a global batch that is a multiple of it")
        per = self.global_batch // dp_size
        return self.global_indices(step)[dp_rank * per:(dp_rank + 1) * per].copy()

    def epoch(self, step: int) -> float:
        """Epochs completed before ``step`` runs: ``step * G / num_windows`` (float).

        After finishing step k, log ``epoch(k + 1)``.
        """
        return _check_int("step", step, 0) * self.global_batch / self.num_windows

    @staticmethod
    def val_indices(num_val_windows: int, count: int) -> np.ndarray:
        """Fixed, evenly spaced validation windows.

        Args:
            num_val_windows: windows in the validation split (int >= 1).
            count: how many to use; clipped to num_val_windows.
        Returns:
            int64 array (min(count, num_val_windows),), ascending, distinct:
            ``floor(j * num_val_windows / k)`` for j < k (all windows if count is larger).
        Raises:
            DataError: num_val_windows < 1 (validation split too small).
            ValueError: count < 1.
        """
        if isinstance(num_val_windows, (int, np.integer)) and num_val_windows < 1:
            raise DataError("the validation split has no window of the chosen seq_len; "
                            "lower model.block_size (the sequence length) or raise data.val_fraction")
        n = _check_int("num_val_windows", num_val_windows, 1)
        k = min(_check_int("count", count, 1), n)
        return (np.arange(k, dtype=np.int64) * n) // k
