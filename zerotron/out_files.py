"""Result files that a command writes (``bench ... --json/--plot/--markdown``, ``dryrun --json``,
``schedule --out``, ``bench plan --out``): one rule for all of them, here.

* Before the run, :func:`out_file_refusal` / :func:`check_out_files` say why a path cannot take the
  file (a directory, a path through a file, a place this process cannot write), so a bad path costs
  one line and exit code 2 instead of a traceback once the minutes of measuring are over.
* A folder of the path that does not exist yet is not refused: it is created when the file is
  written (:func:`out_path`, :func:`write_out_file`), by every command alike (``dryrun --json`` into
  a missing folder was refused while ``bench ... --json`` created it).
* An existing file is replaced."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["check_out_files", "out_file_refusal", "out_path", "write_out_file"]


def out_file_refusal(path: str | os.PathLike | None, flag: str, example: str) -> str | None:
    """Why ``path`` (the value of option ``flag``) cannot take a result file, or None when it can
    (or is None / empty), by the rule of this module. Refused: a directory, a path through a file
    (no folder can be made there), and a place this process cannot write: the nearest existing
    folder of the path (probed by creating and removing a temporary file there: ``os.access`` says
    yes to root on read-only mounts and in /proc) or an existing read-only file. Missing folders
    are fine (:func:`out_path` creates them). ``example``: a path to suggest."""
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
    to its value (None: not given), each checked by :func:`out_file_refusal`. Raises ValueError
    with the first refusal (one line naming the option, the problem and the fix)."""
    for flag, path in flags.items():
        ext = {"--plot": "png", "--markdown": "md", "--out": "md"}.get(flag, "json")
        refusal = out_file_refusal(path, flag, f"{example_dir}/out.{ext}")
        if refusal:
            raise ValueError(refusal)


def out_path(path: str | os.PathLike) -> Path:
    """``Path(path)`` once the folders it names exist (created as needed): where a result file is
    written (``fig.savefig(out_path(p))``). Raises OSError if they cannot be created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def write_out_file(path: str | os.PathLike, text: str) -> Path:
    """Write result file ``path`` (``text``, UTF-8), creating its missing folders; returns its Path."""
    p = out_path(path)
    p.write_text(text, encoding="utf-8")
    return p
