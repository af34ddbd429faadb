"""Per-setting checks of the configuration sections the parallel plan does not carry: train
hyper-parameters, data, checkpoint, model sizes, device/backend availability. Called by
:func:`zerotron.plan.build_plan`, the one validation layer; raises ConfigError naming the field and
the fix. Pure Python (torch only imported to ask whether CUDA exists when it is requested)."""
from __future__ import annotations

import math
from pathlib import Path

from .config import ConfigError, model_shape
from .config_sections import SECTIONS, Config
from .fields import field_types

__all__ = ["check_values", "CORPORA", "MAX_NEW_TOKENS"]

CORPORA = ("shakespeare", "files", "hf")
INT64 = 2**63  # int settings are limited to [-INT64, INT64): torch's and numpy's int64
MAX_VOCAB = 2**20  # = data.tokenizer.MAX_VOCAB (no tokenizers import here)
MAX_NEW_TOKENS = 100_000
"""the most new tokens one generation may ask for (``zerotron generate --max-new-tokens``, ``log.sample_tokens``):
past the context (block_size) every new token recomputes the last block_size tokens, so a mistyped 10**12 ran for
ever holding a growing row (it was accepted)"""
MAX_TIMEOUT_S = 365 * 24 * 3600
"""the longest parallel.timeout_s (and train.stop_grace_s): 1e10 s failed every rendezvous at once ("timed out after 10000000000000ms", an
overflow inside torch's store), 1e15 s raised OverflowError from timedelta"""


def _need(cond, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _init_from_shape(path: str) -> dict:
    """The shape (``registry.config_meta`` of the family config) of the HF checkpoint at
    ``path``, from its config.json alone: the layout rules (tp divides the heads, pp the layers)
    then hold against the model that will be loaded. Raises ConfigError in one line for a
    missing or unreadable config.json, an unknown model_type or a setting the family lacks."""
    from .models import registry  # imports torch: only when a checkpoint is named

    try:
        return registry.config_meta(registry.hf_config(path))
    except (OSError, ValueError, TypeError, AttributeError, ArithmeticError, KeyError) as e:  # any bad field
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model.init_from {path!r} cannot be loaded: {why}; give a Hugging Face GPT-2, "
                          "Llama or Mixtral directory with settings zerotron implements, or train without model.init_from"
                          ) from None


def check_values(cfg: Config) -> dict:
    """Per-setting checks of the sections the plan does not carry (train hyper-parameters, data,
    checkpoint, model sizes) and the device/backend availability. Returns the resolved model shape
    (``config.model_shape``; with ``model.init_from``, that of the checkpoint's config.json).
    Raises ConfigError naming the field and the fix."""
    t, p, m, d = cfg.train, cfg.parallel, cfg.model, cfg.data
    for sec, cls in SECTIONS.items():  # inf/nan parse as floats; no float field means anything with them
        section = getattr(cfg, sec)
        for name, typ in field_types(cls).items():
            v = getattr(section, name)  # (the messages are built only when a check fails)
            if typ is float and not math.isfinite(v):
                _need(False, f"{sec}.{name} must be a finite number, got {v}")
            # every int ends up in torch / numpy / the checkpoint's int64 (an absurd 10**20 steps was accepted)
            if typ is int and not -INT64 <= v < INT64:
                _need(False, f"{sec}.{name} must fit in 64 bits (|value| < 2**63), got {v}")
    _need(0 <= t.seed < INT64, f"train.seed must be in [0, 2**63), got {t.seed}")
    _need(t.nonfinite in ("skip", "stop"), f"train.nonfinite must be skip or stop, got {t.nonfinite!r}")
    _need(t.nonfinite_limit >= 1, f"train.nonfinite_limit must be >= 1 (consecutive skipped steps), got {t.nonfinite_limit}")
    # the grace timer is a threading.Timer: 1e300 s overflowed it (a traceback at the signal, no grace limit)
    _need(0 < t.stop_grace_s <= MAX_TIMEOUT_S, f"train.stop_grace_s must be > 0 and at most {MAX_TIMEOUT_S:,} seconds "
                                               f"(a year), got {t.stop_grace_s:g}")
    _need(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, f"train.beta1 and train.beta2 must be in [0, 1), got {t.beta1}, {t.beta2}")
    _need(t.eps > 0, f"train.eps must be > 0, got {t.eps}")
    _need(t.optimizer_impl in ("fused", "foreach", "loop"),
          f"train.optimizer_impl must be fused, foreach or loop, got {t.optimizer_impl!r}")
    _need(t.weight_decay >= 0, f"train.weight_decay must be >= 0, got {t.weight_decay}")
    for key in ("steps", "global_batch", "micro_batch"):
        _need(getattr(t, key) >= 1, f"train.{key} must be >= 1, got {getattr(t, key)}")
    _need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    _need(0 <= t.min_lr <= t.lr, f"train.min_lr must be in [0, train.lr={t.lr}], got {t.min_lr}")
    _need(t.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    _need(t.grad_clip >= 0, f"train.grad_clip must be >= 0 (0 disables clipping), got {t.grad_clip}")
    _need(t.device in ("auto", "cpu", "cuda"), f"train.device must be auto, cpu or cuda, got {t.device!r}")
    _need(p.backend in ("auto", "gloo", "nccl"), f"parallel.backend must be auto, gloo or nccl, got {p.backend!r}")
    if t.device == "cuda" or p.backend == "nccl":
        import torch  # only for this check: the plan stays importable without torch

        _need(torch.cuda.is_available(), "train.device = cuda / parallel.backend = nccl need a CUDA device and a "
                                         "CUDA build of torch, and none is available; use train.device = auto "
                                         "(or cpu) and parallel.backend = auto (or gloo)")
    _need(0 < p.timeout_s <= MAX_TIMEOUT_S, f"parallel.timeout_s must be > 0 and at most {MAX_TIMEOUT_S:,} seconds (a "
                                            f"year; larger ones overflow torch's timers), got {p.timeout_s:g}")
    _need(t.eval_every >= 0 and t.eval_batches >= 1, "train.eval_every must be >= 0 and train.eval_batches >= 1")
    _need(0 <= m.dropout < 1, f"model.dropout must be in [0, 1), got {m.dropout}")
    _need(not m.init_from or Path(m.init_from).exists(),
          f"model.init_from {m.init_from!r} does not exist; give a Hugging Face GPT-2 or Llama directory "
          "(config.json + model.safetensors)")
    _need(d.corpus in CORPORA, f"data.corpus must be one of {CORPORA}, got {d.corpus!r}")
    _need(d.corpus == "shakespeare" or d.path, f"data.corpus = {d.corpus!r} needs data.path (a file, directory "
                                               "or dataset name)")
    _need(d.format in ("text", "chat", "prompt_completion"),
          f"data.format must be text, chat or prompt_completion, got {d.format!r}")
    _need(d.format == "text" or d.corpus == "files", f"data.format = {d.format} reads rows of a .jsonl or .parquet "
                                                     "file: set data.corpus = files and data.path to it")
    _need(0 < d.val_fraction <= 0.5, f"data.val_fraction must be in (0, 0.5], got {d.val_fraction}")
    _need(d.vocab_size >= 260 or d.tokenizer, f"data.vocab_size must be >= 260 (256 bytes + specials), got {d.vocab_size}")
    _need(d.vocab_size <= MAX_VOCAB or d.tokenizer, f"data.vocab_size must be at most {MAX_VOCAB:,} (the BPE trainer's "
                                                    f"tables grow with it), got {d.vocab_size:,}; use e.g. 8192")
    if d.doc_mask:
        _check_doc_mask(d)
    _need(cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 0, "checkpoint.every and checkpoint.keep must be >= 0")
    _need(cfg.log.every >= 1, f"log.every must be >= 1 (steps between progress lines), got {cfg.log.every}")
    _need(0 <= cfg.log.sample_tokens <= MAX_NEW_TOKENS,
          f"log.sample_tokens must be in [0, {MAX_NEW_TOKENS:,}] (0 = no sample at the end; past the model's context "
          f"each new token recomputes the whole window), got {cfg.log.sample_tokens:,}")
    _need(cfg.checkpoint.on_error in ("continue", "stop"),
          f"checkpoint.on_error must be continue or stop, got {cfg.checkpoint.on_error!r}")
    for key in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
        _need(getattr(m, key) >= 0, f"model.{key} must be >= 1 (or 0 = from the preset/tokenizer), got {getattr(m, key)}")
    shape = _init_from_shape(m.init_from) if m.init_from else None
    try:
        shape = shape or model_shape(m)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _need(shape["n_embd"] % shape["n_head"] == 0,
          f"model.n_embd ({shape['n_embd']}) must be divisible by model.n_head ({shape['n_head']}); change one of them")
    _need(shape["block_size"] >= 2, f"model.block_size must be >= 2, got {shape['block_size']}")
    kv = shape.get("n_kv_head", shape["n_head"])
    _need(shape["n_head"] % kv == 0, f"model.n_head ({shape['n_head']}) must be a multiple of model.n_kv_head "
                                     f"({kv}): each kv head serves n_head / n_kv_head query heads")
    if not m.init_from:
        from .models.registry import config_from_section  # the family's own checks (torch-free module)

        try:
            config_from_section(m, m.vocab_size or shape.get("vocab_size") or 256)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None
    return shape


EOT = "<|endoftext|>"  # = data.tokenizer.EOT (no tokenizers import here)


def _check_doc_mask(d) -> None:
    """``data.doc_mask`` needs document boundaries: a separator token in the tokenizer (``data.
    tokenizer``; a trained BPE always has one) and a corpus of more than one document (a single
    ``.txt`` file under ``data.corpus = files`` is one document). With ``data.format`` chat /
    prompt_completion it packs several rows per window (``data.sft``). The separator is the end
    token: ``data.eos_token``, else the tokenizer's own (its tokenizer_config.json), else
    ``<|endoftext|>``. Raises ConfigError."""
    if d.tokenizer and not d.eos_token:
        import json

        path = Path(d.tokenizer).expanduser()
        path = path / "tokenizer.json" if path.is_dir() else path
        try:
            conf = json.loads((path.parent / "tokenizer_config.json").read_text())
            own_eos = isinstance(conf, dict) and bool(conf.get("eos_token"))
        except (OSError, ValueError):
            own_eos = False
        try:
            spec = None if own_eos else json.loads(path.read_text())
        except (OSError, ValueError):
            spec = None  # unreadable: the data loader names the problem
        if spec is not None:
            added = {t.get("content") for t in spec.get("added_tokens") or []}
            vocab = (spec.get("model") or {}).get("vocab") or {}
            _need(EOT in added or (isinstance(vocab, dict) and EOT in vocab),
                  f"data.doc_mask needs a document separator token, and data.tokenizer {str(path)!r} has no {EOT}; "
                  "use a tokenizer that defines it (or leave data.tokenizer unset to train one), or set "
                  "data.doc_mask = false")
    if d.corpus == "files" and d.path and Path(d.path).suffix == ".txt" and not Path(d.path).is_dir():
        _need(False, f"data.doc_mask masks attention at document boundaries, and data.path {d.path!r} is one .txt "
                     "file, one document with no boundary; give a .jsonl/.parquet file or a directory of documents, "
                     "or set data.doc_mask = false")
