"""What every zerotron command does with an error: one line ``zerotron: error: ...`` on stderr and
exit code 2 (:func:`fail`), and the exception types that count as user errors."""
from __future__ import annotations


def fail(msg: str) -> int:
    """Print ``zerotron: error: <msg>`` on stderr (once for all the workers of a ``--nproc``
    launch that find the same error: ``launch_worker.say_once``); returns the exit code 2."""
    from ..launch_worker import say_once

    say_once(f"zerotron: error: {msg}")
    return 2


def collective_error():
    """The CollectiveError type (a dead or hung peer; imported only when an ``except`` needs it)."""
    from ..distributed.watchdog import CollectiveError

    return CollectiveError


def user_errors():
    """The exception types that are the user's to fix (config, data, checkpoint, files): caught as
    one line and exit code 2."""
    from ..config import ConfigError
    from ..data import DataError
    from ..train.checkpoint import CheckpointError

    return (ConfigError, DataError, CheckpointError, FileNotFoundError, FileExistsError)


def out_of_memory(e: BaseException) -> str | None:
    """The one line for an allocation that failed (torch's CPU allocator: "DefaultCPUAllocator: can't
    allocate memory: you tried to allocate N bytes"; torch.OutOfMemoryError on a GPU; a MemoryError,
    e.g. numpy's for the windows of an absurd train.global_batch), or None for
    any other error: the sizes to shrink and the commands that estimate them."""
    import re

    text = str(e)
    # numpy's MemoryError: "Unable to allocate 7.28 TiB for an array with shape ..."
    if not (type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in text or isinstance(e, MemoryError)):
        return None
    m = re.search(r"allocate (\d+) bytes", text) or re.search(r"allocate ([\d.]+ [KMGT]iB)", text)
    size = f"{int(m.group(1)):,} bytes" if m and m.group(1).isdigit() else (m.group(1) if m else "more than is free")
    where = "GPU" if type(e).__name__ == "OutOfMemoryError" else "host"
    return (f"out of {where} memory: an allocation of {size} failed; the model or batch is too large for this "
            "machine: shrink model.n_embd, model.n_layer, model.block_size or train.micro_batch, or shard it "
            "over more ranks (estimate first: 'zerotron memory', 'zerotron plan')")
