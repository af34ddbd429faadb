"""The fake process group of a dry run (``analysis.dryrun``) made to behave like the backend it
stands for: point-to-point works that report completion, the backend-dependent code paths of the
plan's backend, and one step's ``comm.STATS`` summed per group."""
from __future__ import annotations

import contextlib


def comm_by_group(stats) -> dict:
    """``{group: {"bytes", "calls", "ops": {"op/tag": {"calls", "bytes"}}}}`` from ``comm.STATS``
    (bytes in its nccl-tests size convention)."""
    out: dict = {}
    for (op, group, tag), b in sorted(stats.bytes.items()):
        g = out.setdefault(group, {"bytes": 0, "calls": 0, "ops": {}})
        calls = stats.calls[(op, group, tag)]
        g["bytes"] += b
        g["calls"] += calls
        g["ops"][f"{op}/{tag}"] = {"calls": calls, "bytes": b}
    return dict(sorted(out.items()))


class _Done:
    """A fake-backend point-to-point ``Work`` that says it is complete once posted. The fake
    backend moves nothing, so it is; but torch's ``FakeWork.is_completed()`` answers False forever,
    and the pipeline's poster (``pipeline.p2p.CommRunPoster``), which drops a send's tensor once
    its Work is complete, then kept every gradient the last stage sent until the end of the walk
    (7 of Llama-3-8B's 8 micro-batches at the loss's backward: 7 x 128 MiB)."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def p2p_completes_at_once():
    """``torch.distributed.batch_isend_irecv`` returns :class:`_Done` works while the context is
    active (the pipeline's path on a backend other than gloo, the fake one included; isend/irecv
    stay: ``P2POp`` checks their identity)."""
    import torch.distributed as dist

    batch = dist.batch_isend_irecv

    def done(*args, **kwargs):
        return [_Done(w) for w in batch(*args, **kwargs)]

    dist.batch_isend_irecv = done
    try:
        yield
    finally:
        dist.batch_isend_irecv = batch


@contextlib.contextmanager
def code_paths_of(backend: str):
    """While active, the fake process groups answer ``torch.distributed.get_backend`` with
    ``backend``, so code that picks its path by the backend takes the path of the backend the plan
    names (``parallel.backend``; "auto" traces NCCL's: a dry run predicts a GPU job). The one such
    path of a training step is the pipeline's (``pipeline.p2p.CommRunPoster``): on gloo it posts
    sends and receives one by one and the next comm run's receives early (one more message buffer
    in flight per direction); elsewhere one ``batch_isend_irecv`` per run. A gloo send reports
    completion only once waited (``Work.is_completed()`` stays False after the peer has received
    it; torch 2.13, checked), so on gloo the poster holds every send of a walk until
    ``finish_walk``: the fake backend's sends, which never say complete, are held the same way."""
    import torch.distributed as dist

    saved = dist.get_backend
    if backend == "gloo":
        dist.get_backend = lambda group=None: backend
    try:
        yield
    finally:
        dist.get_backend = saved
