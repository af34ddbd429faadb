"""Copies between the device and the host that run beside the training loop (ZeRO-Offload, Ren et al.
2021, section 4.2: gradients leave the device as each bucket is reduced, updated parameters come back
while the next forward runs), with the time they took and the time the loop waited for them.

A copy is a job on one background thread per process (:func:`worker`, FIFO, so copies complete in the
order they were issued); :meth:`HostCopies.copy` returns a ``concurrent.futures.Future`` and
:meth:`HostCopies.wait` blocks until it is done. On a CUDA device the job also runs on its own CUDA
stream: it first waits for an event recorded on the issuing thread's current stream (so the copy
reads what the device computed before the issue, e.g. a reduce-scatter's output), copies with
``non_blocking=True`` (the host buffers are pinned, ``FlatShard``) and synchronises that stream before
the future completes, so a completed future means the data has arrived. (Not exercised here: this
machine has no GPU; the CPU path runs the same jobs as plain ``copy_`` calls, which release the GIL,
so the copy overlaps the Python thread's compute.)

Accounting (:meth:`HostCopies.timing`): ``copy_s``, the seconds the jobs ran (on CUDA including the
wait for the issuing stream's event), and ``wait_s``, the seconds the loop was blocked in
:meth:`HostCopies.wait`; the hidden fraction is ``1 - wait_s / copy_s``."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["HostCopies", "worker"]

_POOLS: dict = {}
_LOCK = threading.Lock()


def worker(name: str) -> ThreadPoolExecutor:
    """The process's single-thread executor called ``name`` (created on first use; a forked child
    gets its own, as threads do not survive a fork)."""
    with _LOCK:
        key = (name, os.getpid())
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(1, thread_name_prefix=f"zerotron-{name}")
        return pool


class HostCopies:
    """Background copies for one gradient synchroniser, and their timing.

    Args: ``device`` (the compute device: a CUDA device gets a side stream). Attributes ``copy_s``,
    ``wait_s`` (float seconds since the last :meth:`timing`), ``copies`` (int)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copy_s = self.wait_s = 0.0
        self.copies = 0

    def run(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the copy thread (on CUDA inside the side stream, after the issuing
        stream's work so far); returns its Future (result: the job's seconds)."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()

        def job():
            t0 = time.perf_counter()
            if self.stream is None:
                fn(*args)
            else:
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    fn(*args)
                self.stream.synchronize()
            return time.perf_counter() - t0
        return worker("offload").submit(job)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Future:
        """``dst.copy_(src)`` in the background (non-blocking on CUDA: pinned host memory)."""
        return self.run(lambda: dst.copy_(src, non_blocking=self.stream is not None))

    def wait(self, fut: Future | None) -> None:
        """Block until ``fut`` is done (None: nothing); counts its run time and the time blocked.
        Re-raises the job's exception."""
        if fut is None:
            return
        t0 = time.perf_counter()
        spent = fut.result()
        self.wait_s += time.perf_counter() - t0
        self.copy_s += spent
        self.copies += 1

    def timing(self) -> dict:
        """``{"copy_s", "wait_s", "copies"}`` since the last call, then reset."""
        out = {"copy_s": self.copy_s, "wait_s": self.wait_s, "copies": self.copies}
        self.copy_s = self.wait_s = 0.0
        self.copies = 0
        return out
