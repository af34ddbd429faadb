"""A gradient sync and the threaded pipeline are freed when nothing holds them (with their model,
gradient buffers and process groups): a long-lived process (repeated ``Trainer`` builds, a pooled
test rank, a parity spawn) would otherwise keep every one it built, and each destroyed gloo group
that such a sync holds keeps three threads (one polling every 10 ms)."""
import gc
import weakref

import torch

from zerotron.parallel.base import post_accumulate_hooks
from zerotron.parallel.pipeline.threads import _Worker


class _Sync:
    def __init__(self, module):
        self.module, self.seen = module, []
        self.hooks = post_accumulate_hooks(list(module.parameters()), self._on_grad)

    def _on_grad(self, p):
        self.seen.append(p.shape)


def test_post_accumulate_hooks_do_not_keep_their_sync_alive():
    """torch keeps post-accumulate hooks where the collector cannot see them: a hook bound to the
    sync directly made model <-> sync an uncollectable cycle (every DataParallel, torch-DDP wrapper
    and ZeRO driver of a process lived until its end)."""
    m = torch.nn.Linear(3, 2)
    s = _Sync(m)
    m(torch.ones(4, 3)).sum().backward()
    assert sorted(map(tuple, s.seen)) == [(2,), (2, 3)]
    ref_s, ref_m = weakref.ref(s), weakref.ref(m)
    del s, m
    gc.collect()
    assert ref_s() is None and ref_m() is None


def test_an_idle_stage_worker_keeps_no_task():
    """The threaded pipeline's worker threads stop when the pipeline is freed (``__del__``); an idle
    worker that still held its last task (whose closure holds the pipeline) kept it alive for good."""
    class Payload:
        pass

    w, p = _Worker("test-stage"), Payload()
    ref = weakref.ref(p)
    w.tasks.put(lambda p=p: id(p))
    assert w.done.get(timeout=30) == (id(p), None)
    del p
    gc.collect()
    try:
        assert ref() is None
    finally:
        w.stop()
        w.thread.join(timeout=30)
