"""Count the Python interpreters a command starts, and what each imported (issue 27).

Put this folder first on ``PYTHONPATH`` and name a log file in ``ZEROTRON_PROC_LOG``; every
interpreter started under it (pytest, pooled ranks, the fork server, ``--nproc`` workers, servers)
then appends one ``START`` line (pid, parent pid, argv) when it starts and one line at exit (pid,
parent pid, its own user + system CPU seconds, which of :data:`HEAVY` it had imported, argv)::

    ZEROTRON_PROC_LOG=/tmp/p.log PYTHONPATH=benchmarks/proc_log:. python -m pytest tests/test_x.py
    grep -c ^START /tmp/p.log        # interpreters started (a fork is not one: it starts no line)

A process that ends by ``os._exit`` or a signal has a START line and no exit line. Only a
measuring aid: a ``sitecustomize`` already on the path (a virtual environment's) is shadowed.
"""
import atexit
import os
import sys

HEAVY = ("torch", "torch._dynamo", "torch._inductor", "torch.distributed.tensor", "torch.distributed.checkpoint",
         "torch.distributed.fsdp", "sympy", "matplotlib", "transformers", "tokenizers", "safetensors", "fastapi",
         "uvicorn", "tensorboard", "zerotron.parallel")
_LOG = os.environ.get("ZEROTRON_PROC_LOG")


def _line(text: str) -> None:
    with open(_LOG, "a") as f:  # one short write per line: appends of concurrent processes stay whole
        f.write(text)


def _at_exit() -> None:
    try:
        t = os.times()
        mods = " ".join(m for m in HEAVY if m in sys.modules)
        _line(f"END\t{os.getpid()}\t{os.getppid()}\t{t.user + t.system:.2f}\t{mods}\t{' '.join(sys.argv)[:300]}\n")
    except Exception:  # noqa: BLE001 - never disturb the measured process
        pass


if _LOG:
    _line(f"START\t{os.getpid()}\t{os.getppid()}\t{' '.join(sys.argv)[:300]}\n")
    atexit.register(_at_exit)
