"""An opened token cache (:class:`TokenData`): the cache format version, the id dtype of a
vocabulary, and :func:`load_token_data`, which opens a complete cache directory read-only
(``zerotron.data.dataset`` builds them)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .corpus import DataError
from .tokenizer import SpecialTokens, load_tokenizer, read_special_tokens

FORMAT_VERSION = 1


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
