"""Token caches: built once per input, reused, opened.

:func:`prepare_data` turns a corpus into two flat token files (``train.bin``,
``val.bin``: documents each followed by the EOT id) plus ``tokenizer.json`` and
``meta.json``, under ``cache_dir/<key>/``. The key hashes everything the files
depend on, so a changed input builds a new cache and an unchanged one is reused.
A cache directory appears atomically (built in a temporary sibling, then renamed),
so readers never see a half-written one and racing builders are harmless.

Instruction data (``data.format`` chat / prompt_completion, :mod:`zerotron.data.sft`) adds a loss
mask per split (``train.mask``, ``val.mask``: one uint8 per token) and lays out one row per window
of S tokens, so its cache also depends on S.

Beside this module: :mod:`zerotron.data.token_cache` (the format, :class:`TokenData`, opening a
cache), :mod:`zerotron.data.encode` (documents to a token file), :mod:`zerotron.data.windows`
(the training windows of a split); the names users import from here are re-exported.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from . import sft
from .corpus import DataError, check_val_fraction, corpus_fingerprint, load_corpus, split_documents
from .encode import _encode_to_file
from .token_cache import FORMAT_VERSION, TokenData, load_token_data, token_dtype
from .tokenizer import (
    check_vocab_size,
    load_tokenizer,
    read_special_tokens,
    tokenizer_file,
    train_bpe,
    write_special_files,
)
from .windows import batch_from_indices, num_windows

STALE_TMP_SECONDS = 24 * 3600  # unfinished build directories older than this are removed

__all__ = ["TokenData", "batch_from_indices", "cache_key", "load_token_data", "num_windows", "prepare_data",
           "token_dtype"]


def _file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def cache_key(corpus: str = "shakespeare", path: str | Path | None = None,
              text_field: str = "text", vocab_size: int = 8192, val_fraction: float = 0.05,
              tokenizer_path: str | Path | None = None, special_tokens: dict | None = None,
              format: str = "text", seq_len: int | None = None, pack: bool = False) -> tuple[str, dict]:
    """Compute the cache key of :func:`prepare_data`'s arguments without reading text.

    Returns:
        ``(key, inputs)``: a 16-hex-digit key and the JSON-able dict it hashes
        (format version, corpus fingerprint with file sizes/mtimes, vocab_size or
        None when a tokenizer file is given, val_fraction, tokenizer file SHA-256, the resolved
        special tokens when a tokenizer is given, the config's ``special_tokens`` overrides).
        An ``"hf"`` corpus is keyed by its name only: a changed hub dataset reuses
        the old cache until you delete it.
    Raises:
        DataError: bad corpus/path, val_fraction, vocab_size or tokenizer_path.
    """
    val_fraction = check_val_fraction(val_fraction)
    tok_hash, specials = None, None
    overrides = {k: v for k, v in (special_tokens or {}).items() if v}
    if tokenizer_path is None:
        check_vocab_size(vocab_size)
    else:
        sp = read_special_tokens(tokenizer_path, None, overrides)  # validates the files
        tok_hash = _file_sha256(tokenizer_file(tokenizer_path))
        specials = {**sp.tokenizer_config(), **sp.generation_config()}
    inputs = {
        "format_version": FORMAT_VERSION,
        "source": corpus_fingerprint(corpus, path, text_field),
        "vocab_size": vocab_size if tokenizer_path is None else None,
        "val_fraction": val_fraction,
        "tokenizer_sha256": tok_hash,
    }
    if specials is not None or overrides:  # (absent: the keys of caches built before them stay valid)
        inputs["special_tokens"] = specials or overrides
    if format != "text":
        if format not in sft.FORMATS:
            raise DataError(f"data.format must be one of {sft.FORMATS}, got {format!r}")
        if not seq_len or seq_len < 2:
            raise DataError(f"data.format = {format} lays out one row per window and needs seq_len >= 2, got {seq_len!r}")
        inputs["format"], inputs["seq_len"] = format, int(seq_len)
        if pack:  # (absent when off: the keys of padded caches built before packing stay valid)
            inputs["pack"] = True
    blob = json.dumps(inputs, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16], inputs


def prepare_data(corpus: str = "shakespeare", path: str | Path | None = None,
                 text_field: str = "text", vocab_size: int = 8192, val_fraction: float = 0.05,
                 cache_dir: str | Path = ".cache/zerotron",
                 tokenizer_path: str | Path | None = None, special_tokens: dict | None = None,
                 format: str = "text", seq_len: int | None = None, pack: bool = False) -> TokenData:
    """Build (or reuse) the token cache of a corpus and open it.

    Steps: load the corpus, split each document (tail to validation), train a BPE
    tokenizer on the train split only (or load ``tokenizer_path``; vocab_size is
    then ignored), encode both splits, write ``cache_dir/<key>/``. An existing
    complete cache with the same key is opened without any work; a ``.tmp-*`` build
    directory left by a killed build is removed after a day. Not coordinated
    across processes: in a distributed job let one rank build it first, then the
    others open it (a race is still safe, only wasteful).

    Args:
        corpus, path, text_field: see :func:`zerotron.data.load_corpus`.
        vocab_size: BPE vocabulary size (int >= 257).
        val_fraction: share of each document's characters for validation, (0, 0.5].
        cache_dir: root directory of token caches.
        tokenizer_path: optional existing tokenizer (a tokenizer.json or a directory holding one,
            see :func:`zerotron.data.tokenizer.load_tokenizer`) to use instead of training.
        special_tokens: config overrides of the special tokens (``data.bos_token``, ...; see
            :func:`zerotron.data.tokenizer.read_special_tokens`); the resolved tokens are written to
            the cache's tokenizer_config.json / generation_config.json.
        format: "text" (documents), "chat" or "prompt_completion" (rows of a .jsonl/.parquet
            ``path``, one per window of ``seq_len`` tokens, with a loss mask; see :mod:`zerotron.data.sft`).
        seq_len: the window length S (the model's block_size); needed by the instruction formats.
        pack: instruction formats only: pack several rows per window, each ended by the end token
            (``data.doc_mask``; see :mod:`zerotron.data.sft`); False: one padded row per window.
    Returns:
        :class:`TokenData` with memory-mapped splits.
    Raises:
        DataError: any bad input (see load_corpus, split_documents, train_bpe,
            load_tokenizer), a corrupt existing cache, a cache_dir that cannot be created, or one that
            refuses the build's writes (read-only, full: the partial build is removed).
    """
    key, inputs = cache_key(corpus, path, text_field, vocab_size, val_fraction, tokenizer_path, special_tokens,
                            format, seq_len, pack)
    root = Path(cache_dir).expanduser()
    final = root / key
    if final.exists():
        return load_token_data(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir {str(root)!r} cannot be created ({e.strerror}): give a writable "
                         "folder with --data.cache_dir") from None
    for stale in root.glob(".tmp-*"):  # left by builds killed over a day ago
        try:
            if time.time() - stale.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # another process removed it first
            pass
    tmp: Path | None = None
    try:
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
            _build(tmp, key, inputs, corpus, path, text_field, vocab_size, val_fraction,
                   tokenizer_path, special_tokens, format, seq_len, pack)
            os.chmod(tmp, 0o755)
        except OSError as e:  # a read-only or full cache_dir: one line (the partial build is removed first)
            if not _cache_write_failed(e, root):
                raise
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp = None
            raise DataError(f"cannot write the token cache under data.cache_dir {str(root)!r} ({e.strerror or e}; "
                            f"{_free_bytes(root)} free): free space there or give a writable folder with room "
                            "with --data.cache_dir") from None
        try:
            os.replace(tmp, final)
            tmp = None
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            # another process finished the same cache first: keep theirs, drop ours
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_token_data(final)


def _cache_write_failed(e: OSError, root: Path) -> bool:
    """Whether ``e`` (raised while building a cache under ``root``) is the cache folder refusing a
    write -- full, over quota, read-only, not permitted, or any error on a path under ``root`` --
    rather than an error reading the corpus or the tokenizer."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG):
        return True
    try:
        return e.filename is not None and Path(e.filename).resolve().is_relative_to(root.resolve())
    except (OSError, ValueError):
        return False


def _free_bytes(root: Path) -> str:
    """``"N bytes"`` free on ``root``'s filesystem, or ``"unknown bytes"``."""
    try:
        return f"{shutil.disk_usage(root).free:,} bytes"
    except OSError:
        return "unknown bytes"


def _build(out: Path, key: str, inputs: dict, corpus: str, path, text_field: str,
           vocab_size: int, val_fraction: float, tokenizer_path, special_tokens=None, format: str = "text",
           seq_len: int | None = None, pack: bool = False) -> None:
    """Write tokenizer.json, its tokenizer_config.json and generation_config.json, train.bin,
    val.bin and finally meta.json into ``out``."""
    start = time.perf_counter()
    if format != "text":
        return _build_rows(out, key, inputs, path, vocab_size, val_fraction, tokenizer_path, special_tokens,
                           format, seq_len, start, pack)
    docs = load_corpus(corpus, path, text_field)
    train_docs, val_docs = split_documents(docs, val_fraction)
    if tokenizer_path is None:
        tok = train_bpe(train_docs, vocab_size, out / "tokenizer.json")
    else:
        shutil.copyfile(tokenizer_file(tokenizer_path), out / "tokenizer.json")
        tok = load_tokenizer(out / "tokenizer.json")
    sp = read_special_tokens(tokenizer_path or out / "tokenizer.json", tok, special_tokens)
    write_special_files(out, sp)
    vocab, eot = tok.get_vocab_size(), sp.eos_id
    dtype = token_dtype(vocab)
    counts = {name: _encode_to_file(tok, split, eot, dtype, out / f"{name}.bin")
              for name, split in (("train", train_docs), ("val", val_docs))}
    meta = {
        "format_version": FORMAT_VERSION, "key": key, "inputs": inputs,
        "vocab_size": vocab, "eot_id": eot, "dtype": dtype.name,
        "train_tokens": counts["train"], "val_tokens": counts["val"],
        "documents": len(docs), "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "train_chars": sum(map(len, train_docs)), "val_chars": sum(map(len, val_docs)),
        "build_seconds": round(time.perf_counter() - start, 3),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _row_texts(row: dict) -> list[str]:
    """The strings of a row (message contents, prompt, completion): what a tokenizer trains on."""
    out = [m.get("content") for m in row.get("messages") or [] if isinstance(m, dict)]
    return [t for t in out + [row.get("prompt"), row.get("completion")] if isinstance(t, str) and t]


def _build_rows(out: Path, key: str, inputs: dict, path, vocab_size: int, val_fraction: float, tokenizer_path,
                special_tokens, format: str, seq_len: int, start: float, pack: bool = False) -> None:
    """The instruction-data cache: rows split (the last ``round(n * val_fraction)`` to
    validation, at least one of two or more), laid out one per window with masks (:mod:`.sft`)."""
    rows = sft.read_rows(path)
    if len(rows) < 2:  # was: "the validation split has no window ...; lower model.block_size", which cannot help
        raise DataError(f"{path}: data.format = {format} needs at least 2 rows, got {len(rows)}: the last "
                        "round(rows x data.val_fraction) rows (at least one) are the validation split and the "
                        "rest train; add rows")
    n_val = min(max(round(len(rows) * val_fraction), 1), len(rows) - 1) if len(rows) > 1 else 0
    splits = {"train": rows[:len(rows) - n_val], "val": rows[len(rows) - n_val:]}
    if tokenizer_path is None:
        tok = train_bpe([t for _, r in splits["train"] for t in _row_texts(r)], vocab_size, out / "tokenizer.json")
    else:
        shutil.copyfile(tokenizer_file(tokenizer_path), out / "tokenizer.json")
        tok = load_tokenizer(out / "tokenizer.json")
    sp = read_special_tokens(tokenizer_path or out / "tokenizer.json", tok, special_tokens)
    write_special_files(out, sp)
    dtype = token_dtype(tok.get_vocab_size())
    meta = {"format_version": FORMAT_VERSION, "key": key, "inputs": inputs, "vocab_size": tok.get_vocab_size(),
            "eot_id": sp.eos_id, "dtype": dtype.name, "format": format, "seq_len": seq_len}
    for name, part in splits.items():
        if not part:
            ids, mask, counts = np.zeros(0, np.int64), np.zeros(0, np.uint8), {"rows": 0, "truncated_rows": 0,
                                                                               "dropped_rows": 0, "target_tokens": 0,
                                                                               **({"windows": 0} if pack else {})}
        else:
            ids, mask, counts = sft.build_windows(tok, part, format, sp, seq_len, sp.chat_template, pack)
        ids.astype(dtype).tofile(out / f"{name}.bin")
        mask.tofile(out / f"{name}.mask")
        meta[f"{name}_tokens"] = int(ids.size)
        meta.update({f"{name}_{k}": v for k, v in counts.items()})
    meta["build_seconds"] = round(time.perf_counter() - start, 3)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
