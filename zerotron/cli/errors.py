"""What every zerotron command does with an error: one line ``zerotron: error: ...`` on stderr and
exit code 2 (:func:`fail`), and the exception types that count as user errors."""
from __future__ import annotations


def fail(msg: str) -> int:
    """Print ``zerotron: error: <msg>`` on stderr (once for all the workers of a ``--nproc``
    launch that find the same error: ``launch.say_once``); returns the exit code 2."""
    from ..launch import say_once

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
