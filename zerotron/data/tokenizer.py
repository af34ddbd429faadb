"""Tokenizers: a byte-level BPE (GPT-2 style) trained here, or a checkpoint's own tokenizer as it comes.

A trained tokenizer holds every byte, so any text encodes without unknown tokens and decodes
back exactly; its single special token :data:`EOT` (GPT-2's ``<|endoftext|>``) separates documents.

A tokenizer given as ``data.tokenizer`` is a ``tokenizer.json``, a checkpoint directory or a plain
directory holding ``tokenizer.json`` (and usually ``tokenizer_config.json``). Its special tokens
(:class:`SpecialTokens`) are read from the files beside it, in this order of precedence:
the config (``data.bos_token``, ``data.eos_token``, ``data.pad_token``, ``data.chat_template``),
``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``, ``chat_template``: Hugging
Face's names), then for the stop ids ``generation_config.json`` and ``config.json``
(``eos_token_id``: an id or a list, Llama 3 has several), and last the GPT-2 default
``<|endoftext|>`` when the vocabulary has it. The end token (``eos``) separates documents; every id
of ``eos_ids`` stops generation. :func:`write_special_files` writes them back in the same files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import DataError

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte tokens + EOT
MAX_VOCAB = 2**20
"""the largest vocabulary a BPE is trained to (4x the largest released models'): the trainer's tables grow with
the requested size before any merge (1e9 asked for 70 GB and aborted the process inside Rust)"""


def check_vocab_size(vocab_size: int) -> int:
    """Return ``vocab_size``; DataError unless it is an int in [257, :data:`MAX_VOCAB`]."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) \
            or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"vocab_size must be an integer in [{MIN_VOCAB}, {MAX_VOCAB:,}] (256 bytes + {EOT} at least), "
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
    out_path.write_text(tok.to_str(pretty=True))  # tok.save's bytes; a full disk is an OSError, not a bare Exception
    return tok


def tokenizer_file(path: str | Path) -> Path:
    """The ``tokenizer.json`` of ``path``: the file itself, or ``path/tokenizer.json`` for a
    directory (a checkpoint or a plain tokenizer directory). Raises DataError if there is none."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            steps = sorted((int(d.name[5:]), d) for d in path.glob("checkpoints/step_*")
                           if d.name[5:].isdigit() and (d / "tokenizer.json").is_file())
            hint = (f" (a run directory: its newest checkpoint's is {str(steps[-1][1] / 'tokenizer.json')!r})"
                    if steps else "")
            raise DataError(f"{str(path)!r} is a directory without tokenizer.json; point data.tokenizer at a "
                            f"tokenizer.json or a directory holding one{hint}")
        return path / "tokenizer.json"
    if not path.is_file():
        raise DataError(f"tokenizer file {str(path)!r} does not exist; check the path or "
                        "leave data.tokenizer unset to train one")
    return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer as it comes.

    Args:
        path: a ``tokenizer.json`` (written by :func:`train_bpe` or any HF tokenizers file) or a
            directory holding one (see :func:`tokenizer_file`).
    Returns:
        ``tokenizers.Tokenizer``.
    Raises:
        DataError: the file is missing or not a valid tokenizer.
    """
    path = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a generic Exception on bad JSON
        raise DataError(f"{path}: not a valid tokenizers JSON file ({e}); "
                        "point at a tokenizer.json saved by tokenizers") from None


SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "chat_template")


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special tokens (texts and ids) and chat template.

    Attributes:
        eos: the end token's text (separates documents, ends an assistant turn's loss span).
        eos_id: its id.
        eos_ids: every id that stops generation (``eos_id`` first; Llama 3: ``<|end_of_text|>``
            and ``<|eot_id|>``), a tuple of ints.
        bos, bos_id: the begin token (None: the tokenizer has none).
        pad, pad_id: the padding token (None: padding uses ``eos_id``; padded targets are masked).
        chat_template: a Jinja chat template (Hugging Face's ``apply_chat_template`` variables) or None.
    """

    eos: str
    eos_id: int
    eos_ids: tuple = ()
    bos: str | None = None
    bos_id: int | None = None
    pad: str | None = None
    pad_id: int | None = None
    chat_template: str | None = field(default=None, repr=False)

    @property
    def pad_or_eos(self) -> int:
        """The id that pads a row: ``pad_id``, else ``eos_id``."""
        return self.pad_id if self.pad_id is not None else self.eos_id

    def tokenizer_config(self) -> dict:
        """The ``tokenizer_config.json`` dict (Hugging Face names) of these tokens."""
        out = {"bos_token": self.bos, "eos_token": self.eos, "pad_token": self.pad,
               "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        if self.chat_template:
            out["chat_template"] = self.chat_template
        return out

    def generation_config(self) -> dict:
        """``generation_config.json``'s ids: bos, eos (an int, or the list when several stop)."""
        eos = list(self.eos_ids) if len(self.eos_ids) > 1 else self.eos_id
        return {"bos_token_id": self.bos_id, "eos_token_id": eos, "pad_token_id": self.pad_id}


def _read_json(f: Path) -> dict:
    if not f.is_file():
        return {}
    try:
        out = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{f} is not valid JSON ({e}); fix or remove it") from None
    return out if isinstance(out, dict) else {}


def _token_text(v) -> str | None:
    """A tokenizer_config token entry: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _ids(v) -> list[int]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


def read_special_tokens(path: str | Path, tok: Tokenizer | None = None, overrides: dict | None = None
                        ) -> SpecialTokens:
    """The :class:`SpecialTokens` of the tokenizer at ``path`` (see the module's order of precedence).

    Args:
        path: as for :func:`load_tokenizer`; the JSON files are read from its directory.
        tok: the loaded tokenizer (loaded from ``path`` when None).
        overrides: ``{"bos_token", "eos_token", "pad_token", "chat_template"}`` from the config;
            "" or None leaves the file's value. ``chat_template`` may name a ``.jinja`` file.
    Raises:
        DataError: a named token is not in the vocabulary, or no end token is known.
    """
    file = tokenizer_file(path)
    tok = tok or load_tokenizer(file)
    d = file.parent
    tc, gen, cfg = (_read_json(d / n) for n in ("tokenizer_config.json", "generation_config.json", "config.json"))
    over = {k: v for k, v in (overrides or {}).items() if v}
    vocab_ok = tok.token_to_id

    def text(key: str) -> str | None:
        return over.get(key) or _token_text(tc.get(key))

    def id_of(key: str, t: str | None) -> int | None:
        if t is None:
            return None
        i = vocab_ok(t)
        if i is None:
            raise DataError(f"{file}: {key} {t!r} is not a token of the vocabulary; set data.{key} to one of its "
                            "special tokens")
        return i

    eos = text("eos_token")
    if eos is None and vocab_ok(EOT) is not None:
        eos = EOT  # the GPT-2 default
    if eos is None:
        raise DataError(f"{file}: no end token is known (no eos_token in tokenizer_config.json and no {EOT}); "
                        "set data.eos_token to the tokenizer's end token")
    eos_id = id_of("eos_token", eos)
    stop = [eos_id]
    for src in (gen, cfg):
        for i in _ids(src.get("eos_token_id")):
            if i not in stop and 0 <= i < tok.get_vocab_size(with_added_tokens=True):
                stop.append(i)
    bos = text("bos_token")
    if bos is None and eos == EOT and "eos_token" not in over and not tc:
        bos = EOT  # GPT-2: bos = eos = <|endoftext|>
    pad = text("pad_token")
    template = over.get("chat_template")
    if template and template.endswith((".jinja", ".j2")) and Path(template).expanduser().is_file():
        template = Path(template).expanduser().read_text()
    if template is None:
        t = tc.get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        template = t if isinstance(t, str) and t else None
    if template is None and (d / "chat_template.jinja").is_file():  # transformers 5 writes it apart
        template = (d / "chat_template.jinja").read_text()
    return SpecialTokens(eos=eos, eos_id=eos_id, eos_ids=tuple(stop), bos=bos, bos_id=id_of("bos_token", bos),
                         pad=pad, pad_id=id_of("pad_token", pad), chat_template=template)


def write_special_files(out_dir: str | Path, sp: SpecialTokens) -> None:
    """Write ``tokenizer_config.json`` and ``generation_config.json`` of ``sp`` into ``out_dir``;
    an existing generation_config.json keeps its other keys, and an existing ``config.json`` (a
    Hugging Face model directory) gets the same bos/eos/pad ids. Raises OSError."""
    out_dir = Path(out_dir)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(sp.tokenizer_config(), indent=2) + "\n")
    for name in ("generation_config.json", "config.json"):
        if name == "config.json" and not (out_dir / name).is_file():
            continue
        d = _read_json(out_dir / name)
        d.update(sp.generation_config())
        (out_dir / name).write_text(json.dumps(d, indent=2) + "\n")


def copy_tokenizer(src: str | Path, out_dir: str | Path) -> None:
    """Copy a tokenizer's ``tokenizer.json`` and the special-token files beside it
    (tokenizer_config.json, generation_config.json, chat_template.jinja) into ``out_dir``."""
    import shutil

    file = tokenizer_file(src)
    shutil.copyfile(file, Path(out_dir) / "tokenizer.json")
    for name in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (file.parent / name).is_file():
            shutil.copyfile(file.parent / name, Path(out_dir) / name)
