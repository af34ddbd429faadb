"""Documents encoded into a flat token file: each document followed by the end token, encoded in
batches; with a plain byte-level tokenizer long documents go in pieces cut where its pre-tokenizer
would cut anyway (the same ids as the whole document)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

ENCODE_CHUNK_CHARS = 8_000_000  # documents are encoded in batches of about this many characters
PIECE_CHARS = 4096  # long documents are encoded in pieces of about this many characters
_BOUNDARY = re.compile(r"\S(?=\s)")  # a non-space followed by whitespace


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
