"""The disk tier of optimizer offload (``train.offload = optimizer-disk``; ZeRO-Infinity, Rajbhandari
et al. 2021, section 5): one flat shard's fp32 (fp64) master and its Adam moments live in a
memory-mapped file under ``train.offload_dir/rank-N``, and the optimizer step reads and writes them
one chunk at a time.

How the mapped pages stay out of the process's resident set: the file is mapped ``MAP_SHARED``,
so a page written through it belongs to the page cache, not to the process; after use
:meth:`DiskState.release` calls ``madvise(MADV_DONTNEED)`` on the pages, which unmaps them from this
process (RSS drops) while their contents stay in the file: the kernel writes the dirty pages back in
the background and may drop clean ones under memory pressure. The file is unlinked right after it is
mapped (its descriptor stays open for the step's reads and writes): its blocks are freed when the
process ends, even by ``kill -9``, and no stale state is ever read (a resumed run loads the
checkpoint into the fresh mapping).

The step (:func:`disk_step`, ZeRO-Infinity's overlap-centric design, section 6.3) streams the state
through a few staging buffers instead of touching the mapping: a reader thread ``pread``s the next
chunks' master and Adam moments (across buffers: the next buffer's first chunk while the current
buffer's last one steps), the training thread steps the chunk in the staging buffers, a writer
thread ``pwrite``s it back (write-behind); at most ``depth`` chunk buffers exist, so the state's
resident memory is bounded by ``depth x 3 x chunk`` elements whatever the model size. ``pread`` and
``pwrite`` go through the same page cache as the mapping, so both views stay coherent."""
from __future__ import annotations

import contextlib
import mmap
import os
import queue
import shutil
import threading
import time
import weakref

import torch
import torch.distributed as dist

from zerotron.config import ConfigError
from zerotron.parallel.data.host_copies import worker

CHUNK = 1 << 19  # elements per staged chunk of disk_step (a multiple of every SIMD width: same bits as one pass)
DEPTH = 3  # staged chunks in flight: one being read ahead, one stepping, one being written behind


class DiskState:
    """Three ``k``-element ``dtype`` vectors (``master``, ``exp_avg``, ``exp_avg_sq``) in one mapped file.

    Args: ``path`` (the file to create: its folder must exist, the file must not -- FileExistsError), ``k`` (elements per vector), ``dtype``
    (torch.float32 or float64). Each vector starts on a page boundary. Attributes: ``tensors``
    ({name: 1-D CPU tensor viewing the mapping}), ``nbytes`` (file size in bytes). The vectors start
    as zeros (a fresh file, its blocks reserved by ``posix_fallocate``). Raises OSError when the file
    cannot be created or its blocks reserved (ENOSPC: the disk is full)."""

    NAMES = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, path: str, k: int, dtype: torch.dtype):
        self.k, self.dtype = k, dtype
        self.esize = torch.empty(0, dtype=dtype).element_size()
        page = mmap.PAGESIZE
        self.region = max(page, -(-k * self.esize // page) * page)
        self.nbytes = self.region * len(self.NAMES)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # never another run's file (or a user's)
        try:
            os.ftruncate(fd, self.nbytes)
            # reserve every block now: a store through the mapping into a hole of a full disk is a
            # SIGBUS (the process dies without a word), a pwrite there an ENOSPC in the middle of a step
            os.posix_fallocate(fd, 0, self.nbytes)
            self.mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(path)  # the mapping and the descriptor keep the inode; nothing is left behind at exit
        self.fd = fd  # for disk_step's pread / pwrite; closed with this object
        weakref.finalize(self, os.close, fd)
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

    def _io(self, write: bool, name: str, lo: int, buf: torch.Tensor) -> None:
        """Read (``pread``) or write (``pwrite``) elements [lo, lo + len(buf)) of vector ``name``
        from or to the contiguous CPU tensor ``buf`` (same dtype). Raises OSError on an I/O error
        or a short transfer."""
        view = memoryview(buf.numpy()).cast("B")
        off = self.NAMES.index(name) * self.region + lo * self.esize
        while len(view):
            n = os.pwrite(self.fd, view, off) if write else os.preadv(self.fd, [view], off)
            if n <= 0:
                raise OSError(f"{'write to' if write else 'read from'} the optimizer state file: {n} bytes at {off}")
            view, off = view[n:], off + n

    def release(self, lo: int = 0, hi: int | None = None) -> None:
        """Drop elements [lo, hi) (default: all) from this process's resident set (``MADV_DONTNEED``
        on a shared file mapping: the values stay in the file / page cache)."""
        self._advise(mmap.MADV_DONTNEED, lo, self.k if hi is None else hi)


def state_files_refusal(offload_dir: str, rank_dir: str, error: OSError) -> str:
    """The one line for ``error``, raised while this rank created its state files in ``rank_dir``
    (under ``train.offload_dir`` = ``offload_dir``): what failed, the bytes free there, the fix. The
    launcher checks the folder before any process starts (``analysis.memory.offload_dir_refusal``);
    this is for a disk that another writer fills (or a folder that turns read-only) after that check."""
    try:
        free = f"{shutil.disk_usage(offload_dir).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    return (f"train.offload_dir {offload_dir!r}: cannot create the optimizer state files in {rank_dir!r} "
            f"({error.strerror or error}; {free}): free space there or choose another folder with room "
            "(--train.offload_dir)")


@contextlib.contextmanager
def rank_state_dir(offload_dir: str):
    """This rank's folder of state files, ``offload_dir/rank-<global rank>`` (rank 0 without a
    process group), made if missing and yielded for the files to be created in; a folder made here
    is removed on exit when empty (every file is unlinked once mapped, or on failure). Raises
    ConfigError (:func:`state_files_refusal`'s line) for an OSError inside the context."""
    disk_dir, made = os.path.join(offload_dir, f"rank-{dist.get_rank() if dist.is_initialized() else 0}"), False
    try:
        made = not os.path.isdir(disk_dir)
        os.makedirs(disk_dir, exist_ok=True)
        yield disk_dir
    except OSError as e:  # the folder filled or turned read-only after the launcher's check
        raise ConfigError(state_files_refusal(offload_dir, disk_dir, e)) from None
    finally:
        if made:
            try:
                os.rmdir(disk_dir)
            except OSError:
                pass


def disk_step(optimizer, jobs: list, chunk: int = CHUNK, depth: int = DEPTH) -> dict:
    """One torch optimizer step of each ``(param, grad, disk)`` in ``jobs`` (``param``'s data and Adam
    state are ``disk``'s mapped vectors, ``grad`` its gradient, same length, on any device), streamed
    chunk by chunk through ``depth`` staging buffers (module docstring): the reader thread reads
    chunk i + 1 .. while chunk i steps, the writer thread writes chunk i - 1 .. back, in job order
    (the next buffer's reads start while the current one's last chunk steps). For each chunk the
    parameter's data, gradient and state are swapped for the staged chunk's views and
    ``optimizer.step()`` runs (every other parameter must have ``grad`` None); AdamW is elementwise,
    so the bits equal one step over each whole vector; each parameter's step count advances once.
    ``optimizer.state[param]`` must hold "step", "exp_avg" and "exp_avg_sq" (the mapped vectors;
    ``FlatShard.init_state``). Leaves ``param.grad`` None, the full views in place and every write
    done. Returns ``{"io_s": seconds the I/O threads read and wrote, "io_wait_s": seconds this thread
    waited for them}``. Raises OSError from a failed read or write (after the writes in flight end)."""
    if not jobs:
        return {"io_s": 0.0, "io_wait_s": 0.0}
    dtype = jobs[0][2].dtype
    if any(d.dtype != dtype for _, _, d in jobs):
        raise ValueError("disk_step: every job's state must have one dtype")
    free: queue.Queue = queue.Queue()
    for _ in range(depth):
        free.put({n: torch.empty(chunk, dtype=dtype) for n in DiskState.NAMES})
    stop = threading.Event()
    io = [0.0, 0.0]  # seconds reading (reader thread), writing (writer thread)

    def read(disk, a, b):
        while True:  # a staging buffer: bounded memory (blocks until the writer returns one)
            try:
                bufs = free.get(timeout=0.05)
                break
            except queue.Empty:
                if stop.is_set():
                    return None
        t0 = time.perf_counter()
        for n in DiskState.NAMES:
            disk._io(False, n, a, bufs[n][:b - a])
        io[0] += time.perf_counter() - t0
        return bufs

    def write(disk, a, b, bufs):
        t0 = time.perf_counter()
        try:
            for n in DiskState.NAMES:
                disk._io(True, n, a, bufs[n][:b - a])
        finally:
            io[1] += time.perf_counter() - t0
            free.put(bufs)

    pieces = [(j, a, min(a + chunk, disk.k)) for j, (_, _, disk) in enumerate(jobs) for a in range(0, disk.k, chunk)]
    reads = [worker("disk-read").submit(read, jobs[j][2], a, b) for j, a, b in pieces]
    writes = []
    waited = 0.0
    saved = [(p.data, optimizer.state[p]) for p, _, _ in jobs]
    saved = [(data, st, st["exp_avg"], st["exp_avg_sq"], st["step"]) for data, st in saved]
    stepped = [s[4] for s in saved]
    try:
        for i, (j, a, b) in enumerate(pieces):
            param, grad, _ = jobs[j]
            t0 = time.perf_counter()
            bufs = reads[i].result()
            waited += time.perf_counter() - t0
            state, step0 = saved[j][1], saved[j][4]
            param.data = bufs["master"][:b - a]
            param.grad = grad[a:b].to(param.data.device)
            state["exp_avg"], state["exp_avg_sq"], state["step"] = bufs["exp_avg"][:b - a], bufs["exp_avg_sq"][:b - a], \
                step0.clone()
            optimizer.step()
            stepped[j] = state["step"]
            param.grad = None
            writes.append(worker("disk-write").submit(write, jobs[j][2], a, b, bufs))
    finally:
        stop.set()
        for f in reads:
            f.cancel()
        t0 = time.perf_counter()
        errors = [f.exception() for f in writes]
        waited += time.perf_counter() - t0
        for (param, _, _), (data, state, m, v, _), st in zip(jobs, saved, stepped):
            param.data, param.grad = data, None
            state["exp_avg"], state["exp_avg_sq"], state["step"] = m, v, st
    for e in errors:
        if e is not None:
            raise e
    return {"io_s": io[0] + io[1], "io_wait_s": waited}
