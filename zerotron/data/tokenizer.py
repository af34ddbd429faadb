"""Byte-level BPE tokenizer (GPT-2 style) built with Hugging Face ``tokenizers``.

Every byte is in the vocabulary, so any text encodes without unknown tokens and
decodes back exactly. The single special token :data:`EOT` separates documents.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import DataError

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte tokens + EOT


def check_vocab_size(vocab_size: int) -> int:
    """Return ``vocab_size``; DataError unless it is an int in [257, 2**32)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not MIN_VOCAB <= vocab_size < 2**32:
        raise DataError(f"vocab_size must be an integer >= {MIN_VOCAB} (256 bytes + {EOT}), "
                        f"got {vocab_size!r}; use e.g. 8192")
    return vocab_size


def train_bpe(texts: list[str], vocab_size: int, out_path: str | Path) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` only and save it as JSON.

    ByteLevel pre-tokenizer (GPT-2 regex, no prefix space) and ByteLevel decoder;
    the initial alphabet holds all 256 bytes; :data:`EOT` is the special token with
    id 0. Training is deterministic for the same texts and vocab_size.

    Args:
        texts: training documents (``list[str]``).
        vocab_size: target vocabulary size incl. bytes and EOT (int >= 257). A
            small corpus may end with fewer tokens: read ``get_vocab_size()``.
        out_path: where to write the tokenizer JSON (parent dirs are created).
    Returns:
        The trained ``tokenizers.Tokenizer``.
    Raises:
        DataError: vocab_size not an int >= 257, or no non-empty text.
    """
    check_vocab_size(vocab_size)
    if not any(t for t in texts):
        raise DataError("cannot train a tokenizer on no text; give it a non-empty corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer JSON file that defines :data:`EOT`.

    Args:
        path: a ``tokenizer.json`` written by :func:`train_bpe` (or any HF
            tokenizer file with an ``<|endoftext|>`` token, e.g. GPT-2's).
    Returns:
        ``tokenizers.Tokenizer``.
    Raises:
        DataError: the file is missing, not a valid tokenizer, or lacks EOT.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"tokenizer file {str(path)!r} does not exist; check the path or "
                        "leave data.tokenizer unset to train one")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a generic Exception on bad JSON
        raise DataError(f"{path}: not a valid tokenizers JSON file ({e}); "
                        "point at a tokenizer.json saved by tokenizers") from None
    if tok.token_to_id(EOT) is None:
        raise DataError(f"{path}: tokenizer has no {EOT} token; use a tokenizer that defines "
                        "it (train one with train_bpe)")
    return tok
