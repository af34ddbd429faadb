"""What a run needs before its first step: the model config of the model section, the checks of
the run directory and of a ``--resume`` (model shape, newest intact checkpoint), the token data,
and this dp rank's evaluation windows. Used by the trainer, the CLI launcher and the benchmarks."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError, model_shape
from ..config_sections import Config
from ..data import prepare_data
from ..distributed import comm
from ..models import registry
from . import checkpoint as ckpt

__all__ = ["gpt_config", "check_init_vocab", "check_run_dir", "check_resume", "load_data", "val_rank_windows", "padding_batch",
           "SHAPE_KEYS"]


def gpt_config(cfg: Config, tokenizer_vocab: int):
    """The model config (GPTConfig or LlamaConfig, by model.arch / the preset) of the model
    section; vocab = model.vocab_size or the tokenizer's size. Raises ConfigError if
    model.vocab_size is smaller than the tokenizer's vocabulary or the section is invalid."""
    vocab = cfg.model.vocab_size or tokenizer_vocab
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size ({vocab}) is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}); set model.vocab_size = 0 to use the tokenizer's size")
    try:
        return registry.config_from_section(cfg.model, vocab)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_init_vocab(model_vocab: int, tokenizer_vocab: int) -> None:
    """``model.init_from``: the checkpoint's embedding must have a row for every token id of the
    tokenizer. Raises ConfigError naming the fix."""
    if model_vocab < tokenizer_vocab:
        raise ConfigError(f"model.init_from has vocab_size {model_vocab} < the tokenizer's {tokenizer_vocab}; "
                          "set data.tokenizer to the checkpoint's tokenizer.json")


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to start a fresh run over an existing one (nothing on disk is overwritten), and
    refuse ``--resume`` without a checkpoint. Raises ConfigError naming the fix."""
    saved = ckpt.list_checkpoints(run_dir)
    metrics = run_dir / "metrics.jsonl"
    # an empty metrics.jsonl is a run stopped before its first step (a signal during start-up, after
    # rank 0 opened the file): nothing to keep, so a fresh start may take the directory
    if not saved and metrics.exists() and metrics.stat().st_size > 0:  # stopped (kill -9, out of memory) before
        # its first checkpoint: neither a fresh start (it would write over the metrics) nor --resume can take it
        raise ConfigError(f"{'--resume: ' if resume else ''}run directory {str(run_dir)!r} already holds a run without "
                          "a checkpoint (only metrics.jsonl), so there is nothing to resume; choose a new "
                          f"--run-dir{' without --resume' if resume else ''}, or delete {str(run_dir)!r} to start "
                          "over there")
    if not resume and saved:
        raise ConfigError(f"run directory {str(run_dir)!r} already holds a run; pass --resume to continue "
                          "it, or choose a new --run-dir")
    if resume and not saved:
        raise ConfigError(f"--resume: no checkpoint under {str(run_dir / 'checkpoints')!r}; "
                          "start without --resume")


SHAPE_KEYS = ("arch", "n_layer", "n_head", "n_embd", "block_size")


def eval_clip_note(n_val: int, eval_batches: int, global_batch: int, seq_len: int) -> str | None:
    """The one line saying that ``train.eval_batches`` x ``train.global_batch`` asks for more
    validation windows than the split holds (``n_val`` windows of ``seq_len`` tokens), so each
    evaluation reads the whole split once (``GlobalBatchSampler.val_indices`` clips, it never
    wraps); None when the split holds them. A silent clip made e.g. 1000000000 look like a hang
    (every evaluation ran over the whole split with no word)."""
    asked = eval_batches * global_batch
    if asked <= n_val:
        return None
    return (f"zerotron: note: train.eval_batches {eval_batches:,} x train.global_batch {global_batch:,} asks for "
            f"{asked:,} validation windows, more than the split holds ({n_val:,} windows of {seq_len} tokens): each "
            f"evaluation reads all of them once, {(k := -(-n_val // global_batch)):,} global batch{'es' * (k > 1)}; lower "
            "train.eval_batches to evaluate less")


def val_rank_windows(val_idx: np.ndarray, dp_rank: int, dp: int, micro_batch: int) -> list[np.ndarray]:
    """This dp rank's validation windows, grouped into evaluation micro-batches.

    ``val_idx`` (n,) window indices is split into ``dp`` contiguous chunks (``np.array_split``:
    disjoint, together all of ``val_idx``, sizes differ by at most one); each chunk is cut into
    micro-batches of at most ``micro_batch`` windows. Every rank gets the *same number* of
    micro-batches, ``ceil(ceil(n / dp) / micro_batch)``: a rank with fewer windows gets empty
    (0,) arrays at the end, which the caller evaluates as padding batches with no target token.
    Sharded strategies (ZeRO-3, FSDP2) all-gather parameters in every forward, so an unequal
    number of forwards per dp rank would leave one rank's collectives without a partner.

    Returns a list of int64 arrays, each of length 0..micro_batch.
    Raises ValueError if ``dp < 1``, ``micro_batch < 1`` or ``dp_rank`` is not in ``[0, dp)``."""
    if dp < 1 or micro_batch < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"need dp >= 1, micro_batch >= 1 and 0 <= dp_rank < dp, got dp_rank {dp_rank}, "
                         f"dp {dp}, micro_batch {micro_batch}")
    chunks = np.array_split(np.asarray(val_idx, dtype=np.int64), dp)
    n_batches = max(-(-len(c) // micro_batch) for c in chunks)
    mine = chunks[dp_rank]
    out = [mine[i:i + micro_batch] for i in range(0, len(mine), micro_batch)]
    return out + [mine[:0]] * (n_batches - len(out))


def padding_batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An evaluation batch that adds nothing: x (1, seq_len) of token 0, y (1, seq_len) all
    ``IGNORE_INDEX`` (loss sum 0 and token count 0 under every strategy's summed loss)."""
    from .step import IGNORE_INDEX  # here, not at the top: the launcher imports this module without the engine

    return (torch.zeros(1, seq_len, dtype=torch.int64),
            torch.full((1, seq_len), IGNORE_INDEX, dtype=torch.int64))


def pad_rows(batch: tuple[torch.Tensor, torch.Tensor], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` (x, y), each (b, T) int64, with ``rows - b`` rows of :func:`padding_batch` appended
    (token 0, every target ``IGNORE_INDEX``: no loss, no token counted), so every evaluation batch
    has the same shape (``train.compile``: one static evaluation graph). Unchanged if b >= rows."""
    from .step import IGNORE_INDEX

    x, y = batch
    extra = rows - x.size(0)
    if extra <= 0:
        return batch
    return (torch.cat([x, x.new_zeros(extra, x.size(1))]),
            torch.cat([y, y.new_full((extra, y.size(1)), IGNORE_INDEX)]))


# the data.* settings that decide which tokens train and validate (vocab_size and the tokenizer
# are checked against the checkpoint's tokenizer; cache_dir is only where the tokens are kept)
DATA_STREAM_KEYS = ("corpus", "path", "text_field", "val_fraction", "format")


def check_resume(cfg: Config, run_dir: Path, quarantine: bool = True, tokenizer_note: bool = False) -> Path:
    """For ``--resume``: the newest checkpoint that is intact (files present, checksums equal;
    damaged ones are skipped with a warning and, with ``quarantine``, renamed damaged_step_<N>),
    after checking the model shape of ``cfg`` and its :data:`DATA_STREAM_KEYS` equal the saved ones; sets ``data.tokenizer`` to the
    checkpoint's tokenizer.json unless one is given (the token ids must not change under the
    embeddings). Checksums are not re-hashed for the checkpoint named by ZEROTRON_CKPT_VERIFIED
    (set once verified). A metrics.jsonl that cannot be read past a torn last line is refused.
    ``tokenizer_note``: print one note line (stderr) when ``data.vocab_size`` differs from the one
    the run started with, which the checkpoint's tokenizer overrides (the process that speaks for
    the run: the launcher or a single process). Raises ConfigError / CheckpointError."""
    newest = ckpt.latest_checkpoint(run_dir)
    rehash = os.environ.get("ZEROTRON_CKPT_VERIFIED") != str(newest)
    latest = ckpt.newest_good_checkpoint(run_dir, quarantine, verify_checksums=rehash)
    os.environ["ZEROTRON_CKPT_VERIFIED"] = str(latest)  # workers started after this skip the hashing
    meta = ckpt.read_meta(latest)
    saved = meta.get("model_config", {})
    if not cfg.model.init_from:
        shape = model_shape(cfg.model)
        saved = {"arch": registry.DEFAULT_ARCH, **saved}  # checkpoints without arch are GPT-2
        # every resolved field the checkpoint recorded (sizes, bias, the llama fields); one it lacks
        # (an older checkpoint) is not compared; vocab_size is checked against the tokenizer later
        now = json.loads(json.dumps(shape))
        diff = [f"{k} {saved.get(k)} (checkpoint) vs {now[k]} (now)" for k in now
                if k != "vocab_size" and (k in SHAPE_KEYS or k in saved) and saved.get(k) != now[k]]
        if diff:
            raise ConfigError(f"--resume: the model shape differs from the checkpoint {str(latest)!r}: "
                              f"{'; '.join(diff)}; resume with the checkpoint's model settings")
    check_resume_lora(cfg, meta.get("config", {}).get("train", {}), latest)
    was = meta.get("config", {}).get("data", {})
    diff = [f"data.{k} {was[k]!r} (checkpoint) vs {getattr(cfg.data, k)!r} (now)" for k in DATA_STREAM_KEYS
            if k in was and was[k] != getattr(cfg.data, k)]
    if cfg.data.format != "text" and was.get("doc_mask", cfg.data.doc_mask) != cfg.data.doc_mask:  # packed vs padded rows
        diff.append(f"data.doc_mask {was['doc_mask']!r} (checkpoint) vs {cfg.data.doc_mask!r} (now; it packs or pads "
                    f"the {cfg.data.format} rows)")
    if diff:
        raise ConfigError(f"--resume: the training data differs from that of the checkpoint {str(latest)!r}: "
                          f"{'; '.join(diff)}; resume with the checkpoint's data settings, or train on the new data "
                          "in a new run: zerotron export the checkpoint and pass the exported directory as "
                          "--model.init_from")
    if (run_dir / "metrics.jsonl").is_file():  # read again (kept records) once the run starts: fail here, in one line
        from .metrics import read_metrics

        try:
            read_metrics(run_dir / "metrics.jsonl")
        except ValueError as e:  # was a traceback from every rank after the model was built
            raise ConfigError(f"--resume: {e}, then resume (nothing was changed)") from None
    if not cfg.data.tokenizer and (latest / "tokenizer.json").is_file():
        if tokenizer_note and was.get("vocab_size", cfg.data.vocab_size) != cfg.data.vocab_size:  # was silently ignored
            print(f"zerotron: note: --resume keeps the checkpoint's tokenizer (data.vocab_size {was['vocab_size']} when "
                  f"the run started); data.vocab_size {cfg.data.vocab_size} is ignored: the token ids must not change "
                  "under the trained embeddings (a new vocabulary needs a new run)", file=sys.stderr)
        cfg.data.tokenizer = str(latest)  # the directory: its tokenizer_config.json comes along
    return latest


def check_resume_lora(cfg: Config, saved_train: dict, latest: Path) -> None:
    """Refuse a ``--resume`` whose LoRA adapters differ from the checkpoint's: ``train.lora_rank``
    (0 = none) and, when both have adapters, the projections ``train.lora_targets`` resolves to
    (:func:`zerotron.models.layout.lora_targets`). Either decides which state-dict keys and shapes
    the checkpoint holds, so a mismatch would otherwise fail inside every worker's load. A
    checkpoint that recorded no ``lora_rank`` (older runs) is not compared. Raises ConfigError
    (one line naming both values and the fix)."""
    if "lora_rank" not in saved_train:
        return
    fix = ("resume with the checkpoint's LoRA settings, or start a new run from it: zerotron export the "
           "checkpoint (merged) and pass the exported directory as --model.init_from")
    was, now = int(saved_train["lora_rank"]), cfg.train.lora_rank
    if was != now:
        raise ConfigError(f"--resume: train.lora_rank {was} (checkpoint {str(latest)!r}) vs {now} (now); {fix}")
    if not now:
        return
    from ..models.layout import lora_targets  # plain data, no torch

    family = "gpt2" if model_shape(cfg.model).get("arch", "gpt2") == "gpt2" else "llama"
    try:
        a, b = (lora_targets(family, str(saved_train.get("lora_targets", ""))),
                lora_targets(family, cfg.train.lora_targets))
    except (ValueError, KeyError):
        return  # the plan reports a bad spec of its own
    if a != b:
        raise ConfigError(f"--resume: train.lora_targets {','.join(a)} (checkpoint {str(latest)!r}) vs "
                          f"{','.join(b)} (now); {fix}")


def special_overrides(cfg: Config) -> dict:
    """The config's special-token overrides (``data.bos_token``, ``eos_token``, ``pad_token``,
    ``chat_template``; "" = the tokenizer's own)."""
    return {k: getattr(cfg.data, k) for k in ("bos_token", "eos_token", "pad_token", "chat_template")}


def seq_len_of(cfg: Config) -> int:
    """The training sequence length: the block_size of model.init_from's config.json, else of
    the model section (fields, preset, defaults)."""
    if cfg.model.init_from:
        return int(registry.config_meta(registry.hf_config(cfg.model.init_from))["block_size"])
    return int(model_shape(cfg.model)["block_size"])


def data_kwargs(cfg: Config) -> dict:
    """``prepare_data``'s arguments for the data section of ``cfg`` (the launcher and every worker
    must build and open the same cache)."""
    d = cfg.data
    return dict(corpus=d.corpus, path=d.path or None, text_field=d.text_field, vocab_size=d.vocab_size,
                val_fraction=d.val_fraction, cache_dir=d.cache_dir, tokenizer_path=d.tokenizer or None,
                special_tokens=special_overrides(cfg), format=d.format,
                seq_len=seq_len_of(cfg) if d.format != "text" else None, pack=d.doc_mask and d.format != "text")


def train_device(cfg: Config) -> torch.device | None:
    """The device ``train.device`` names: ``cpu``, ``cuda`` (``cuda:<LOCAL_RANK>``), or None for
    ``auto`` (``distributed.mesh.init_distributed`` then picks CUDA when present, else the CPU)."""
    return {"cpu": torch.device("cpu"), "cuda": torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))}.get(
        cfg.train.device)


def load_data(cfg: Config, local_rank: int):
    """Build/open the token cache: local rank 0 builds it first, the others then open it."""
    kwargs = data_kwargs(cfg)
    if local_rank == 0:
        data = prepare_data(**kwargs)
    comm.wait_barrier(comm.IO_TIMEOUT_S, tag="token_cache")  # may take minutes: its own long timeout
    if local_rank != 0:
        data = prepare_data(**kwargs)
    return data
