"""``python -m zerotron.worker_state OUT``: write the process state a launched worker starts with.

A probe for :mod:`zerotron.launch_fork`'s test: ``launch(N, [OUT], module="zerotron.worker_state")``
makes each worker append one JSON line to the file ``OUT`` with what a fork must reproduce of a
fresh interpreter (session, parent, inherited descriptors, signal dispositions, ``atexit``
handlers, unbuffered standard streams, glibc's heap thresholds in effect, torch's global
defaults, the global RNGs' seeds (torch, numpy, Python), the worker's environment), so a
test can compare forked workers with exec'd ones. :func:`state` returns the same as a dict.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import sys

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGPIPE", "SIGXFSZ", "SIGCHLD", "SIGALRM")


def _handler(h) -> str:
    if h is signal.default_int_handler:
        return "default_int_handler"
    if h in (signal.SIG_DFL, signal.SIG_IGN):
        return signal.Handlers(h).name
    return "python handler" if callable(h) else repr(h)


def _reused_heap_block() -> bool:
    """Whether a freed 48 MiB block is reused rather than mapped again (glibc's thresholds of
    :mod:`zerotron.host_heap` in effect): 4 rounds fault in under a tenth of one block's pages (under
    glibc's defaults, each round faults all of them again; :func:`zerotron.host_heap.block_faults`)."""
    from zerotron.host_heap import block_faults

    return block_faults(48 << 20, 4) < (48 << 20) // os.sysconf("SC_PAGE_SIZE") // 10


def state() -> dict:
    """This process's start-up state (see the module); descriptors are those beyond 0-2 that are
    open on anything but ``/dev/null``, as ``{fd: what /proc says it is}``."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor
            continue
        if int(name) > 2 and target != os.devnull:
            fds[int(name)] = target
    state = {"rank": int(os.environ.get("RANK", -1)), "own_session": os.getsid(0) == os.getpid(),
             "parent": os.getppid(), "fds": fds,
             "signals": {s: _handler(signal.getsignal(getattr(signal, s))) for s in _SIGNALS},
             "atexit_handlers": atexit._ncallbacks(),
             "unbuffered": [getattr(f, "write_through", False) for f in (sys.stdout, sys.stderr)],
             "argv_tail": sys.argv[1:],
             "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS",
                                                    "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}}
    from . import host_heap

    if host_heap.wanted({}):
        state["heap_block_reused"] = _reused_heap_block()
    import random

    import numpy
    import torch

    state["rng"] = [torch.initial_seed(), int(numpy.random.randint(1 << 62)), random.getrandbits(64)]
    state["torch"] = {"threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()),
                          "grad": torch.is_grad_enabled()}
    return state


if __name__ == "__main__":
    line = json.dumps(state(), sort_keys=True)
    with open(sys.argv[1], "a") as f:
        f.write(line + "\n")
