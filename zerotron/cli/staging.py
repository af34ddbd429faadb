"""Output directories written whole or not at all (``zerotron export``): every file goes to a hidden
staging directory beside the target, which becomes the target (or, with ``--overwrite``, whose
files replace the target's, each by one ``os.replace``) only after the last file is written. A
write that fails (a full disk, EIO) removes the staging directory and leaves the target as it was,
so a failed ``--overwrite`` never truncates the previous export."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["check_out_dir", "staged_dir", "write_failure"]


def check_out_dir(out: str | Path, overwrite: bool, flag: str = "--out") -> Path:
    """Return ``out`` as a Path; raise FileExistsError (one line naming ``flag`` and the fix) if it
    is a file, or a non-empty directory and not ``overwrite``; ValueError (one line) if the folder
    that will hold its staging directory (``out``'s parent, or the nearest existing folder above,
    where the missing ones are made) is a file or cannot be written (probed by making and removing
    a directory there: ``os.access`` says yes to root on read-only mounts and in /proc)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{flag} {str(out)!r} exists and is not a directory; choose another {flag} directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{flag} {str(out)!r} is not empty; choose a new directory or pass --overwrite to "
                              "replace its files")
    holder = out.resolve().parent
    while not holder.exists():
        holder = holder.parent
    if not holder.is_dir():
        raise ValueError(f"{flag} {str(out)!r}: {str(holder)!r} is a file, not a directory; choose another {flag} "
                         "directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".zerotron-probe-", dir=holder))
    except OSError as e:
        raise ValueError(f"{flag} {str(out)!r}: cannot write in {str(holder)!r} ({e.strerror or e}); choose an "
                         f"{flag} directory in a folder you can write") from None
    return out


@contextlib.contextmanager
def staged_dir(out: str | Path, overwrite: bool, flag: str = "--out"):
    """Context manager yielding an empty staging directory (``.<name>.tmp-*`` beside ``out``, the
    mode a plain ``mkdir`` would give) to write ``out``'s files into. On a clean exit the staging
    directory is renamed to ``out`` (absent or empty) or, with ``overwrite``, its files replace
    ``out``'s of the same name (other files of ``out`` stay). On any exception it is removed and
    ``out`` is untouched. Raises FileExistsError as :func:`check_out_dir`; OSError from creating
    the parent or the staging directory."""
    out = check_out_dir(out, overwrite, flag)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700; the export is a directory like any other
        yield tmp
        if out.is_dir() and any(out.iterdir()):
            for f in sorted(tmp.iterdir()):
                os.replace(f, out / f.name)
            tmp.rmdir()
        else:
            os.replace(tmp, out)  # rename(2) replaces an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_failure(out: str | Path, err: Exception, flag: str = "--out", needed: int | None = None) -> str:
    """One line for an error met while writing ``out`` (an OSError, or safetensors' SafetensorError
    wrapping one): the error, the free bytes of its file system (and ``needed``, the bytes the export
    takes, when known), that nothing of ``out`` changed, and the fix. A full disk (ENOSPC, however
    wrapped) names the folder where space must be freed."""
    out = Path(out)
    where = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    try:
        free = f"{shutil.disk_usage(where).free:,} bytes free on {str(where)!r}"
    except OSError:
        free = "free space unknown"
    text = str(err)
    full = getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in text or "os error 28" in text
    if full:  # safetensors' writer wraps it: "Error while serializing: I/O error: No space left ... (os error 28)"
        need = f"it needs about {needed:,} bytes, " if needed else ""
        return (f"cannot write {flag} {str(out)!r}: no space left on device ({need}{free}); nothing was written "
                f"there and an existing {flag} is unchanged; free some space at {str(where)!r} or choose another "
                f"{flag}")
    why = getattr(err, "strerror", None) or text.strip().splitlines()[0]
    return (f"cannot write {flag} {str(out)!r}: {why} ({free}); nothing was written there and an "
            f"existing {flag} is unchanged; fix that or choose another {flag}")
