"""Which parameters got a gradient in this step on *any* data-parallel rank.

Flat gradient buffers make every ``param.grad`` a view that is never None, so a parameter that no
rank used (a skipped block, an unused head) would still be stepped by AdamW on a zero gradient --
unlike torch's optimizer on one process, which skips ``grad is None``. The post-accumulate-grad
hooks mark the parameters used on this rank; one small all-reduce per step (one fp32 per
parameter tensor, tag ``grad_used``) tells every rank the same answer.
"""
from __future__ import annotations

import torch

from zerotron.distributed import comm


class UsedMarks:
    """Per-step "got a gradient" marks of a fixed list of parameters.

    ``mark(p)`` from a gradient hook; ``launch(group, device)`` starts the all-reduce over dp
    (async); ``result()`` waits and returns one bool per parameter (True: used on some rank).
    When this rank used every parameter the answer is all True without reading the reduced
    tensor (no host sync). ``reset()`` at zero_grad."""

    def __init__(self, params):
        self._index = {id(p): i for i, p in enumerate(params)}
        self.reset()

    def reset(self) -> None:
        self._local = [False] * len(self._index)
        self._pending = None

    def mark(self, p) -> None:
        self._local[self._index[id(p)]] = True

    def launch(self, group, device) -> None:
        t = torch.tensor(self._local, dtype=torch.float32, device=device)
        self._pending = (comm.all_reduce(t, group=group, async_op=True, tag="grad_used"), t)

    def result(self) -> list[bool]:
        """One flag per parameter, in construction order. Raises RuntimeError without ``launch``."""
        if self._pending is None:
            raise RuntimeError("UsedMarks.result() before launch()")
        work, t = self._pending
        work.wait()
        self._pending = None
        return [True] * len(self._local) if all(self._local) else (t > 0).tolist()
