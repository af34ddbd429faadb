"""Result files that a command writes after a long run (``bench ... --json``, ``dryrun --json``):
:func:`out_file_refusal` checks, before the run, that each can be written, so a bad path costs one
line and exit code 2 instead of a traceback once the minutes of measuring are over."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["out_file_refusal"]


def out_file_refusal(path: str | os.PathLike | None, flag: str, example: str) -> str | None:
    """Why ``path`` (the value of option ``flag``) cannot take a result file, or None when it can
    (or is None / empty). Refused: a directory, a folder that does not exist, and a folder or an
    existing file this process cannot write (probed by creating and removing a temporary file next
    to it: ``os.access`` says yes to root on read-only mounts and in /proc). An existing file is
    replaced later, as every result file of zerotron is. ``example``: a path to suggest."""
    if not path:
        return None
    p = Path(path)
    fix = f"pass a file path in a writable directory, e.g. {flag} {example}"
    if p.is_dir():
        return f"{flag} {path}: is a directory; {fix}"
    folder = p.resolve().parent
    if not folder.is_dir():
        return f"{flag} {path}: the directory {folder} does not exist; create it or {fix}"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".zerotron-probe-"):
            pass
        if p.exists() and not os.access(p, os.W_OK):
            raise PermissionError("the file is read-only")
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e}); {fix}"
    return None
