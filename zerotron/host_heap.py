"""glibc's heap thresholds for the processes that run training steps ("retain" by default).

A training step frees and re-allocates the same host buffers every step (activations, gradients,
temporaries of a few KiB to tens of MiB). Under glibc's defaults the malloc *mmap threshold* adapts
upwards as blocks are freed and the *trim threshold* returns the heap's free top to the kernel, so
the next step takes the pages back as minor page faults: measured here 1,600-12,000 faults per
step on the default config (varying run to run for the same code), ~50 with the thresholds fixed,
and CPU steps ~25-35 % faster (``benchmarks/issue27_throughput_malloc.md``). "retain" fixes them:

- ``M_MMAP_THRESHOLD`` = 64 MiB: blocks below it come from the heap and are reused, not mapped and
  unmapped per step (setting it also stops glibc's dynamic adjustment);
- ``M_TRIM_THRESHOLD`` = 256 MiB: up to that much free heap top stays mapped between steps.

The cost: freed memory up to those sizes stays resident (RSS reads higher than the live tensors
between steps; ``bench train``'s peak measurement trims first). The opt-out, and the rule that the
user's own setting wins, are stated here once: ``ZEROTRON_HOST_HEAP=release`` keeps glibc's
defaults, and so does any ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` /
``GLIBC_TUNABLES=glibc.malloc...`` already in the environment. Not glibc (musl, macOS): nothing.
Source: glibc manual, "Malloc Tunable Parameters" (``mallopt``, ``M_MMAP_THRESHOLD``,
``M_TRIM_THRESHOLD``).
"""
from __future__ import annotations

import ctypes
import os
import platform

ENV = "ZEROTRON_HOST_HEAP"
"""``retain`` (default) or ``release`` (glibc's defaults)."""
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES, "MALLOC_TRIM_THRESHOLD_": TRIM_THRESHOLD_BYTES}


def wanted(env: dict | None = None) -> bool:
    """Whether zerotron should set the thresholds in a process with environment ``env`` (default
    ``os.environ``): on glibc Linux, ``ZEROTRON_HOST_HEAP`` not ``release``, and no malloc setting of
    the user's own. Raises ValueError for a ``ZEROTRON_HOST_HEAP`` other than retain/release."""
    env = os.environ if env is None else env
    mode = env.get(ENV, "retain").strip().lower()
    if mode not in ("retain", "release"):
        raise ValueError(f"{ENV} must be retain or release, got {env.get(ENV)!r}")
    if mode == "release" or any(k in env for k in _GLIBC_ENV) or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return False
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def worker_env(env: dict | None = None) -> dict:
    """The environment variables that give a process started with ``env`` the "retain" thresholds
    from its first allocation (for launchers: ``{**os.environ, **worker_env()}``); ``{}`` when
    :func:`wanted` says no."""
    return {k: str(v) for k, v in _GLIBC_ENV.items()} if wanted(env) else {}


def retain() -> bool:
    """Set the "retain" thresholds in this process now (``mallopt``), when :func:`wanted`; returns
    whether both were set. Safe to call more than once; raises ValueError as :func:`wanted` does."""
    if not wanted():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    return libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok


def apply_env(env: dict) -> bool:
    """Set in this process now (``mallopt``) the thresholds that ``env``'s ``MALLOC_MMAP_THRESHOLD_``
    / ``MALLOC_TRIM_THRESHOLD_`` name, as glibc does for a process started with that environment
    (for a worker forked rather than exec'd: :mod:`zerotron.launch_fork`). Returns whether any was
    set; False off glibc Linux or without those variables. Raises ValueError for a value that is
    not an integer."""
    wanted_opts = [(opt, int(env[k])) for k, opt in (("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD),
                                                     ("MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD)) if k in env]
    if not wanted_opts or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all([libc.mallopt(opt, value) == 1 for opt, value in wanted_opts])


def block_faults(nbytes: int = 48 << 20, rounds: int = 4) -> int:
    """Minor page faults of ``rounds`` rounds of malloc, touch and free of one ``nbytes`` block (after one
    warm-up round): near 0 when glibc keeps the freed block in the heap (the thresholds of :func:`retain`
    in effect), about ``rounds * nbytes / page size`` when each free unmaps it (glibc's defaults for
    blocks over 32 MiB). A probe for tests; glibc only (raises OSError elsewhere)."""
    import resource

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def once():
        p = libc.malloc(nbytes)
        ctypes.memset(p, 1, nbytes)
        libc.free(p)

    once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        once()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def physical_bytes() -> int:
    """This host's physical memory in bytes (``sysconf``: SC_PHYS_PAGES x SC_PAGE_SIZE; a cgroup
    limit is not read); 0 where the platform does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
