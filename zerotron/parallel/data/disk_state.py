"""The disk tier of optimizer offload (``train.offload = optimizer-disk``; ZeRO-Infinity, Rajbhandari
et al. 2021, section 5): one flat shard's fp32 (fp64) master and its Adam moments live in a
memory-mapped file under ``train.offload_dir/rank-N``, and the optimizer step reads and writes them
one chunk at a time.

How the mapped pages stay out of the process's resident set: the file is mapped ``MAP_SHARED``,
so a page the step wrote belongs to the page cache, not to the process; after each chunk
:meth:`DiskState.release` calls ``madvise(MADV_DONTNEED)`` on the chunk's pages, which unmaps them
from this process (RSS drops) while their contents stay in the file: the kernel writes the dirty
pages back in the background and may drop clean ones under memory pressure. :meth:`prefetch`
(``MADV_WILLNEED``) starts the kernel's read-ahead of the next chunk while the current one steps,
so reads overlap compute without a thread of ours. The file is unlinked right after it is mapped:
its blocks are freed when the process ends, even by ``kill -9``, and no stale state is ever read
(a resumed run loads the checkpoint into the fresh mapping)."""
from __future__ import annotations

import mmap
import os

import torch

CHUNK = 1 << 20  # elements per chunk of the step (a multiple of every SIMD width: same bits as one pass)


class DiskState:
    """Three ``k``-element ``dtype`` vectors (``master``, ``exp_avg``, ``exp_avg_sq``) in one mapped file.

    Args: ``path`` (the file to create; its folder must exist), ``k`` (elements per vector), ``dtype``
    (torch.float32 or float64). Each vector starts on a page boundary. Attributes: ``tensors``
    ({name: 1-D CPU tensor viewing the mapping}), ``nbytes`` (file size in bytes). The vectors start
    as zeros (a fresh sparse file). Raises OSError when the file cannot be created or sized."""

    NAMES = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, path: str, k: int, dtype: torch.dtype):
        self.k, self.dtype = k, dtype
        self.esize = torch.empty(0, dtype=dtype).element_size()
        page = mmap.PAGESIZE
        self.region = max(page, -(-k * self.esize // page) * page)
        self.nbytes = self.region * len(self.NAMES)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self.mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            os.unlink(path)  # the mapping keeps the inode; nothing is left behind at exit
        raw = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.tensors = {n: raw[i * self.region:i * self.region + k * self.esize].view(dtype)
                        for i, n in enumerate(self.NAMES)}

    def _advise(self, advice: int, lo: int, hi: int) -> None:
        """``madvise`` the pages of elements [lo, hi) of every vector (rounded out to pages)."""
        lo, hi = max(lo, 0), min(hi, self.k)
        if lo >= hi:
            return
        page = mmap.PAGESIZE
        a = lo * self.esize // page * page
        b = min(-(-hi * self.esize // page) * page, self.region)
        for i in range(len(self.NAMES)):
            self.mm.madvise(advice, i * self.region + a, b - a)

    def prefetch(self, lo: int = 0, hi: int | None = None) -> None:
        """Start reading elements [lo, hi) (default: all) in the background (``MADV_WILLNEED``)."""
        self._advise(mmap.MADV_WILLNEED, lo, self.k if hi is None else hi)

    def release(self, lo: int = 0, hi: int | None = None) -> None:
        """Drop elements [lo, hi) (default: all) from this process's resident set (``MADV_DONTNEED``
        on a shared file mapping: the values stay in the file / page cache)."""
        self._advise(mmap.MADV_DONTNEED, lo, self.k if hi is None else hi)


def chunked_step(optimizer, param: torch.nn.Parameter, grad: torch.Tensor, disk: DiskState,
                 chunk: int = CHUNK) -> None:
    """One torch optimizer step of ``param`` (whose data and Adam state are ``disk``'s mapped
    vectors) with gradient ``grad`` (same length; copied to the host a chunk at a time), run chunk
    by chunk so at most one chunk of the mapped state is resident: for each chunk the parameter's
    data, gradient and state are swapped for the chunk's views, ``optimizer.step()`` runs (every
    other parameter must have ``grad`` None), the chunk is released and the next one prefetched.
    AdamW is elementwise, so the bits equal one step over the whole vector; the step count
    advances once. ``optimizer.state[param]`` must hold "step", "exp_avg" and "exp_avg_sq" (the
    mapped vectors; ``FlatShard.init_state``). Leaves ``param.grad`` None and the full views in place."""
    state = optimizer.state[param]
    full = param.data
    m, v, step0 = state["exp_avg"], state["exp_avg_sq"], state["step"]
    stepped = step0
    disk.prefetch(0, chunk)
    try:
        for a in range(0, full.numel(), chunk):
            b = min(a + chunk, full.numel())
            disk.prefetch(b, b + chunk)
            param.data = full[a:b]
            param.grad = grad[a:b].to(full.device)
            state["exp_avg"], state["exp_avg_sq"], state["step"] = m[a:b], v[a:b], step0.clone()
            optimizer.step()
            stepped = state["step"]
            disk.release(a, b)
    finally:
        param.data, param.grad = full, None
        state["exp_avg"], state["exp_avg_sq"], state["step"] = m, v, stepped

