"""Result files that a command writes after a long run (``bench ... --json``, ``dryrun --json``):
:func:`out_file_refusal` checks, before the run, that each can be written, so a bad path costs one
line and exit code 2 instead of a traceback once the minutes of measuring are over."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_out_files", "out_file_refusal"]


def out_file_refusal(path: str | os.PathLike | None, flag: str, example: str,
                     make_dirs: bool = False) -> str | None:
    """Why ``path`` (the value of option ``flag``) cannot take a result file, or None when it can
    (or is None / empty). Refused: a directory, a folder that does not exist (with ``make_dirs``,
    for commands that create the missing folders when they write: a path through a file, or whose
    nearest existing folder cannot be written), and a folder or an existing file this process
    cannot write (probed by creating and removing a temporary file next to it: ``os.access`` says
    yes to root on read-only mounts and in /proc). An existing file is replaced later, as every
    result file of zerotron is. ``example``: a path to suggest."""
    if not path:
        return None
    p = Path(path)
    fix = f"pass a file path in a writable directory, e.g. {flag} {example}"
    if p.is_dir():
        return f"{flag} {path}: is a directory; {fix}"
    folder = p.resolve().parent
    if not folder.is_dir():
        held = folder
        while not held.exists():  # the folder that will hold the created ones
            held = held.parent
        if not held.is_dir():  # a path through a file: no folder can be made there (was "does not exist; create it")
            return f"{flag} {path}: {held} is a file, not a directory; {fix}"
        if not make_dirs:
            return f"{flag} {path}: the directory {folder} does not exist; create it or {fix}"
        folder = held
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".zerotron-probe-"):
            pass
        if p.exists() and not os.access(p, os.W_OK):
            raise PermissionError("the file is read-only")
    except OSError as e:
        return f"{flag} {path}: cannot write there ({e.strerror or e}); {fix}"
    return None


def check_out_files(flags: dict[str, str | os.PathLike | None], example_dir: str = "results") -> None:
    """Check the result files of a command before its run: ``flags`` maps each option (``"--json"``)
    to its value (None: not given); missing folders are allowed, the command creates them when it
    writes (:func:`out_file_refusal` with ``make_dirs``). Raises ValueError with the first refusal
    (one line naming the option, the problem and the fix)."""
    for flag, path in flags.items():
        ext = {"--plot": "png", "--markdown": "md", "--out": "md"}.get(flag, "json")
        refusal = out_file_refusal(path, flag, f"{example_dir}/out.{ext}", make_dirs=True)
        if refusal:
            raise ValueError(refusal)
