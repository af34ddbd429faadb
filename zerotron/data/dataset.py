"""Token caches and training windows.

:func:`prepare_data` turns a corpus into two flat token files (``train.bin``,
``val.bin``: documents each followed by the EOT id) plus ``tokenizer.json`` and
``meta.json``, under ``cache_dir/<key>/``. The key hashes everything the files
depend on, so a changed input builds a new cache and an unchanged one is reused.
A cache directory appears atomically (built in a temporary sibling, then renamed),
so readers never see a half-written one and racing builders are harmless.

A split of N tokens holds ``num_windows(N, S) = (N - 1) // S`` windows; window i is
tokens ``[i*S, i*S + S + 1)``, whose first S tokens are the inputs and last S the
targets. Instruction data (``data.format`` chat / prompt_completion, :mod:`zerotron.data.sft`)
adds a loss mask per split (``train.mask``, ``val.mask``: one uint8 per token) and lays out one
row per window, so its cache also depends on S.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from . import sft
from .corpus import DataError, check_val_fraction, corpus_fingerprint, load_corpus, split_documents
from .tokenizer import (
    SpecialTokens,
    check_vocab_size,
    load_tokenizer,
    read_special_tokens,
    tokenizer_file,
    train_bpe,
    write_special_files,
)

FORMAT_VERSION = 1
ENCODE_CHUNK_CHARS = 8_000_000  # documents are encoded in batches of about this many characters
STALE_TMP_SECONDS = 24 * 3600  # unfinished build directories older than this are removed
PIECE_CHARS = 4096  # long documents are encoded in pieces of about this many characters
_BOUNDARY = re.compile(r"\S(?=\s)")  # a non-space followed by whitespace


@dataclass
class TokenData:
    """An opened token cache.

    Attributes:
        train: 1-D read-only ``np.memmap`` of token ids (uint16 if vocab_size < 65536,
            else uint32); documents each followed by ``eot_id``.
        val: the same for the validation split.
        tokenizer: the ``tokenizers.Tokenizer`` that produced the ids.
        tokenizer_path: its ``tokenizer.json`` inside the cache.
        vocab_size: number of token ids (may be below the requested size on tiny corpora).
        eot_id: id of the end token that separates documents (``specials.eos_id``).
        cache_dir: the cache's own directory, ``<cache_dir>/<key>``.
        meta: the parsed ``meta.json`` (token/document counts, key inputs, ...).
    """

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    tokenizer_path: Path
    vocab_size: int
    eot_id: int
    cache_dir: Path
    meta: dict = field(default_factory=dict, repr=False)
    specials: SpecialTokens | None = None
    """the tokenizer's special tokens and chat template (read from the cache's own files)"""
    train_mask: np.ndarray | None = None
    """instruction data: 1 where a token of ``train`` is a training target (uint8), else None"""
    val_mask: np.ndarray | None = None
    """the same for ``val``"""


def token_dtype(vocab_size: int) -> np.dtype:
    """``np.uint16`` if vocab_size < 65536 else ``np.uint32``."""
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


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


def _pieces(doc: str, size: int) -> list[str]:
    """Cut ``doc`` into pieces of about ``size`` chars, each cut between a non-space and
    a whitespace character. The GPT-2 pre-tokenizer never joins such a pair into one
    pre-token, so encoding the pieces gives exactly the ids of the whole document, and
    HF tokenizers encodes many short strings much faster than one long one."""
    out, start = [], 0
    while len(doc) - start > size:
        m = _BOUNDARY.search(doc, start + size - 1)
        if m is None:
            break
        out.append(doc[start:m.start() + 1])
        start = m.start() + 1
    out.append(doc[start:])
    return out


def _splittable(tok: Tokenizer) -> bool:
    """True if ``tok`` is plain GPT-2-style byte-level (safe for :func:`_pieces`)."""
    spec = json.loads(tok.to_str())
    pre, post = spec.get("pre_tokenizer") or {}, spec.get("post_processor") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)
            and post.get("type", "ByteLevel") == "ByteLevel")


def _encode_to_file(tok: Tokenizer, docs: list[str], eot: int, dtype: np.dtype,
                    out: Path) -> int:
    """Encode docs (``encode_batch``), each followed by ``eot``; write raw ids; return count."""
    split = _splittable(tok)
    total = 0
    with open(out, "wb") as f:
        batch: list[str] = []
        ends: list[bool] = []  # True where a piece is the last of its document
        chars = 0
        for k, doc in enumerate(docs):
            pieces = _pieces(doc, PIECE_CHARS) if split else [doc]
            batch += pieces
            ends += [False] * (len(pieces) - 1) + [True]
            chars += len(doc)
            if k == len(docs) - 1 or chars >= ENCODE_CHUNK_CHARS:
                parts = []
                for enc, end in zip(tok.encode_batch(batch, add_special_tokens=False), ends):
                    parts.append(np.asarray(enc.ids, dtype=dtype))
                    if end:
                        parts.append(np.array([eot], dtype=dtype))
                ids = np.concatenate(parts)
                f.write(ids.data)  # ids.tofile's short write on a full disk is an OSError without errno
                total += ids.size
                batch, ends, chars = [], [], 0
    return total


def _open_tokens(file: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """Memory-map ``count`` ids of ``dtype`` read-only; DataError if the size is off."""
    if not file.is_file() or file.stat().st_size != count * dtype.itemsize:
        raise DataError(f"{file} is missing or not {count} tokens of {dtype.name} as meta.json "
                        "says; delete the cache directory and run prepare_data again")
    if count == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(count,))


def load_token_data(path: str | Path) -> TokenData:
    """Open an existing cache directory ``<cache_dir>/<key>``.

    Returns:
        :class:`TokenData` (splits are read-only memmaps).
    Raises:
        DataError: not a complete cache (no meta.json, wrong format version,
            missing/truncated files, bad tokenizer).
    """
    path = Path(path).expanduser()
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{path} is not a complete zerotron token cache (no meta.json); "
                        "delete it and run prepare_data again")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError:
        raise DataError(f"{meta_file} is not valid JSON; delete {path} and run prepare_data "
                        "again") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path} has cache format {meta.get('format_version')!r}, this version "
                        f"reads {FORMAT_VERSION}; delete it and run prepare_data again")
    tok = load_tokenizer(path / "tokenizer.json")
    specials = read_special_tokens(path / "tokenizer.json", tok)
    dtype = np.dtype(meta["dtype"])
    masks = {s: _open_tokens(path / f"{s}.mask", np.dtype(np.uint8), meta[f"{s}_tokens"])
             for s in ("train", "val")} if meta.get("format", "text") != "text" else {}
    return TokenData(
        train=_open_tokens(path / "train.bin", dtype, meta["train_tokens"]),
        val=_open_tokens(path / "val.bin", dtype, meta["val_tokens"]),
        tokenizer=tok, tokenizer_path=path / "tokenizer.json",
        vocab_size=meta["vocab_size"], eot_id=meta["eot_id"], cache_dir=path, meta=meta,
        specials=specials, train_mask=masks.get("train"), val_mask=masks.get("val"),
    )


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Number of training windows, ``max((num_tokens - 1) // seq_len, 0)``.

    Raises:
        DataError: seq_len is not a positive int.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    return max((int(num_tokens) - 1) // int(seq_len), 0)


def batch_from_indices(tokens: np.ndarray, indices, seq_len: int, split: str = "train",
                       mask: np.ndarray | None = None, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows of a token split into an input/target batch.

    Args:
        tokens: 1-D token ids (e.g. ``TokenData.train``, any integer dtype).
        indices: 1-D window indices (B,), each in ``[0, num_windows(len(tokens), seq_len))``.
        seq_len: S, tokens per window input.
        split: split name used in error messages.
        mask: optional loss mask aligned with ``tokens`` (instruction data): a target whose
            mask is 0 becomes ``ignore_index``.
        ignore_index: the target id the loss skips (the strategies' ``IGNORE_INDEX``).
    Returns:
        ``(x, y)``: contiguous ``torch.int64`` tensors of shape (B, S) with
        ``x[b] = tokens[i*S : i*S+S]`` and ``y[b] = tokens[i*S+1 : i*S+S+1]``, i = indices[b]
        (``y`` = ignore_index where ``mask[i*S+1 : i*S+S+1]`` is 0).
    Raises:
        DataError: the split is too small for one window, indices are not 1-D, or
            an index is out of range.
    """
    n = num_windows(len(tokens), seq_len)
    if n == 0:
        raise DataError(f"the {split} split has {len(tokens)} tokens but one window of seq_len "
                        f"{seq_len} needs {seq_len + 1}; lower model.block_size (the sequence length) or use more data "
                        "(for val: a larger val_fraction)")
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 1:
        raise DataError(f"indices must be 1-D, got shape {idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise DataError(f"window index out of range [0, {n}) for the {split} split "
                        f"(min {idx.min()}, max {idx.max()}); use the sampler's indices")
    pos = idx[:, None] * seq_len + np.arange(seq_len + 1)
    windows = torch.from_numpy(np.array(tokens[pos], dtype=np.int64))
    x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if mask is not None:
        keep = torch.from_numpy(np.array(mask[pos[:, 1:]], dtype=np.bool_))
        y = torch.where(keep, y, torch.full_like(y, ignore_index)).contiguous()
    return x, y
