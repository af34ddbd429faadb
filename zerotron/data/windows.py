"""Training windows of a token split: a split of N tokens holds ``num_windows(N, S) = (N - 1) // S``
windows; window i is tokens ``[i*S, i*S + S + 1)``, whose first S tokens are the inputs and last S
the targets."""
from __future__ import annotations

import numpy as np
import torch

from .corpus import DataError


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Number of training windows, ``max((num_tokens - 1) // seq_len, 0)``.

    Raises:
        DataError: seq_len is not a positive int.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    return max((int(num_tokens) - 1) // int(seq_len), 0)


def batch_from_indices(tokens: np.ndarray, indices, seq_len: int, split: str = "train",
                       mask: np.ndarray | None = None, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows of a token split into an input/target batch.

    Args:
        tokens: 1-D token ids (e.g. ``TokenData.train``, any integer dtype).
        indices: 1-D window indices (B,), each in ``[0, num_windows(len(tokens), seq_len))``.
        seq_len: S, tokens per window input.
        split: split name used in error messages.
        mask: optional loss mask aligned with ``tokens`` (instruction data): a target whose
            mask is 0 becomes ``ignore_index``.
        ignore_index: the target id the loss skips (the strategies' ``IGNORE_INDEX``).
    Returns:
        ``(x, y)``: contiguous ``torch.int64`` tensors of shape (B, S) with
        ``x[b] = tokens[i*S : i*S+S]`` and ``y[b] = tokens[i*S+1 : i*S+S+1]``, i = indices[b]
        (``y`` = ignore_index where ``mask[i*S+1 : i*S+S+1]`` is 0).
    Raises:
        DataError: the split is too small for one window, indices are not 1-D, or
            an index is out of range.
    """
    n = num_windows(len(tokens), seq_len)
    if n == 0:
        raise DataError(f"the {split} split has {len(tokens)} tokens but one window of seq_len "
                        f"{seq_len} needs {seq_len + 1}; lower model.block_size (the sequence length) or use more data "
                        "(for val: a larger val_fraction)")
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise DataError(f"indices must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise DataError(f"window index out of range [0, {n}) for the {split} split "
                        f"(min {idx.min()}, max {idx.max()}); use the sampler's indices")
    pos = idx[:, None] * seq_len + np.arange(seq_len + 1)
    windows = torch.from_numpy(np.array(tokens[pos], dtype=np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if mask is not None:
        keep = torch.from_numpy(np.array(mask[pos[:, 1:]], dtype=np.bool_))
        y = torch.where(keep, y, torch.full_like(y, ignore_index)).contiguous()
    return x, y
