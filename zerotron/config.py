"""Configuration: dataclass sections, TOML files, ``--section.field value`` overrides.

Every problem raises :class:`ConfigError` with one message that names the field and the fix. Values
and combinations are checked in one place, :func:`zerotron.plan.build_plan`.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .fields import field_defaults

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad configuration value, file or combination; the message names the field and the fix."""


@dataclass
class ModelConfig:
    """Model family and shape. ``arch``: gpt2 | llama | mixtral (default gpt2, or the preset's family);
    ``preset`` (e.g. "tiny", "gpt2", "llama-tiny", "llama3-8b") fills the sizes; fields that are set
    override it (left unset, their default 0 takes the preset's value, or the built-in default n_layer 4,
    n_head 4, n_embd 128, block_size 128 without a preset; a size set to 0 explicitly is refused). ``vocab_size = 0`` takes the tokenizer's vocabulary size.
    ``block_size`` is also the training sequence length. The llama fields (n_kv_head ...
    rms_norm_eps, tie_word_embeddings) apply to llama only; llama never has biases. ``init_from``:
    a Hugging Face GPT-2 or Llama directory (config.json + model.safetensors) whose family, shape
    and weights the run starts from (use its tokenizer.json as data.tokenizer); every layout slices
    these dense weights per rank."""

    arch: str = "gpt2"
    """model family: gpt2 | llama | mixtral (left unset, the preset's family)"""
    preset: str = ""
    """named shape filling the sizes below (e.g. "tiny", "gpt2", "llama-tiny", "llama3-8b"); "" = built-in default"""
    n_layer: int = 0
    """transformer blocks (0 = from the preset, else 4)"""
    n_head: int = 0
    """attention heads per block (0 = from the preset, else 4)"""
    n_embd: int = 0
    """model width d_model (0 = from the preset, else 128)"""
    block_size: int = 0
    """context length, also the training sequence length (0 = from the preset, else 128)"""
    vocab_size: int = 0
    """embedding rows (0 = the tokenizer's vocabulary size)"""
    dropout: float = 0.0
    """dropout probability in [0, 1)"""
    bias: bool = True
    """biases in the linear and layer-norm layers (GPT-2 style; llama: always off, true is refused)"""
    n_kv_head: int = 0
    """llama: key/value heads of grouped-query attention, dividing n_head (0 = from the preset, else n_head)"""
    intermediate_size: int = 0
    """llama: SwiGLU hidden width (0 = from the preset, else Meta's rule 256*ceil(8*n_embd/3/256))"""
    rope_theta: float = 0.0
    """llama: RoPE base (0 = from the preset, else 10000)"""
    rope_scaling: str = ""
    """llama: none | llama3 (Llama-3.1 values) | llama3:factor=F,low_freq_factor=L,high_freq_factor=H,original_max_position_embeddings=N ("" = the preset's, else none)"""
    rms_norm_eps: float = 0.0
    """llama: RMSNorm epsilon (0 = from the preset, else 1e-5)"""
    tie_word_embeddings: bool = False
    """llama: share the output head with the token embedding (unset = the preset's; gpt2 always ties)"""
    n_experts: int = 0
    """mixtral: experts per MoE layer (0 = from the preset, else 8)"""
    experts_top_k: int = 0
    """mixtral: experts each token is routed to, <= n_experts (0 = from the preset, else 2)"""
    moe_router: str = ""
    """mixtral: topk_softmax (Mixtral: softmax over the top-k logits) | softmax_topk (Qwen-MoE, norm_topk_prob false) ("" = the preset's, else topk_softmax)"""
    moe_shared_intermediate_size: int = 0
    """mixtral: width of a shared SwiGLU expert every token passes (0 = none)"""
    moe_aux_loss_coef: float = 0.01
    """mixtral: weight of the Switch load-balancing loss E*sum(f_i*P_i) (unset = the preset's)"""
    moe_z_loss_coef: float = 0.0
    """mixtral: weight of the router z-loss mean(logsumexp(logits)^2) (unset = the preset's)"""
    moe_capacity_factor: float = 0.0
    """mixtral: 0 = dropless; else training forwards keep at most ceil(factor*tokens*k/E) assignments per expert, first come first served"""
    moe_bias_update_rate: float = 0.0
    """mixtral: 0 = off; else DeepSeek-V3 auxiliary-loss-free balancing, bias += rate*sign(mean load - load) per step"""
    init_from: str = ""
    """Hugging Face GPT-2, Llama or Mixtral directory to start from (family, shape and weights); "" = random init"""

    def given(self, name: str) -> bool:
        """True if field ``name`` was set from a TOML file or the command line (:func:`apply`), or
        holds a value other than its default (set in Python)."""
        return name in self.__dict__.get("_given", ()) or getattr(self, name) != field_defaults(type(self))[name]


@dataclass
class DataConfig:
    """Corpus and tokenizer. ``corpus``: shakespeare | files | hf. ``path``: file/dir or HF dataset
    name. ``tokenizer``: "" trains a byte-level BPE of ``vocab_size`` tokens; else a tokenizer.json or a
    directory holding one; ``bos_token``/``eos_token``/``pad_token``/``chat_template`` override the
    tokenizer's own (see ``data.tokenizer``)."""

    corpus: str = "shakespeare"
    """shakespeare | files | hf"""
    path: str = ""
    """file or directory (files) or dataset name (hf)"""
    text_field: str = "text"
    """text column of an hf dataset"""
    tokenizer: str = ""
    """a tokenizer.json or a directory holding one (a checkpoint); "" = train a byte-level BPE of data.vocab_size tokens"""
    bos_token: str = ""
    """begin token; "" = the tokenizer's own (tokenizer_config.json), if any"""
    eos_token: str = ""
    """end token separating documents; "" = the tokenizer's own, else <|endoftext|>"""
    pad_token: str = ""
    """padding token; "" = the tokenizer's own, else the end token"""
    chat_template: str = ""
    """Jinja chat template (text or a .jinja file); "" = the tokenizer's own"""
    format: str = "text"
    """text (documents) | chat (rows with messages) | prompt_completion; the last two: loss on answers only"""
    vocab_size: int = 8192
    """size of the BPE trained when data.tokenizer is "" (>= 260)"""
    val_fraction: float = 0.05
    """fraction of the tokens held out for validation, in (0, 0.5]"""
    cache_dir: str = ".cache/zerotron"
    """token cache directory (built once, shared by the workers)"""
    doc_mask: bool = False
    """document masking: attention never crosses an end-of-text separator, positions restart per document (chat / prompt_completion: several rows packed per window)"""


@dataclass
class TrainConfig:
    """Optimisation. ``global_batch`` sequences per optimizer step; ``micro_batch`` sequences per
    forward per dp rank; gradient accumulation = global_batch / (micro_batch * dp). ``dtype``: fp32,
    bf16 (autocast) or fp64 (parameters, optimizer state and every collective in float64: numerics
    debugging and the parity matrix; see ``parallel.precision``).
    ``nonfinite``: what a step with a non-finite loss or gradient norm does -- "skip" (no update,
    the LR schedule does not advance; after ``nonfinite_limit`` consecutive skips the run stops) or
    "stop" (stop at the first). ``stop_grace_s``: seconds a SIGTERM/SIGHUP/SIGINT leaves the run to
    finish its step and write a checkpoint before it exits without one (see ``train.lifecycle``)."""

    steps: int = 100
    """optimizer steps to run"""
    seed: int = 1337
    """seed of the initial weights, the batch order and dropout"""
    global_batch: int = 16
    """sequences per optimizer step (over all dp ranks)"""
    micro_batch: int = 8
    """sequences per forward per dp rank; accumulation = global_batch / (micro_batch * dp)"""
    lr: float = 1e-3
    """peak learning rate (after warmup)"""
    min_lr: float = 1e-4
    """learning rate at the end of the cosine decay"""
    warmup_steps: int = 10
    """linear warmup steps"""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only)"""
    beta1: float = 0.9
    """AdamW beta1"""
    beta2: float = 0.95
    """AdamW beta2"""
    eps: float = 1e-8
    """AdamW epsilon"""
    grad_clip: float = 1.0
    """global gradient-norm clip (0 = off)"""
    dtype: str = "fp32"
    """fp32 | bf16 (autocast) | fp64 (numerics debugging, parity)"""
    device: str = "auto"
    """auto | cpu | cuda"""
    eval_every: int = 50
    """validation every N steps, also at the first and last step (0 = never)"""
    eval_batches: int = 4
    """validation size in global batches (more than the split holds: each window once, said in one line)"""
    activation_checkpointing: str = "none"
    """none | selective | full (recompute block activations in the backward)"""
    compile: bool = False
    """torch.compile each transformer block (regional compilation, see parallel.compile)"""
    optimizer_impl: str = "fused"
    """fused | foreach | loop: torch AdamW's kernel (fused: one kernel over every tensor; loop: one parameter at a time)"""
    nonfinite: str = "skip"
    """skip | stop: what a non-finite loss or gradient norm does (skip: no update, counted)"""
    nonfinite_limit: int = 3
    """consecutive skipped steps after which the run stops (exit 3)"""
    stop_grace_s: float = 25.0
    """seconds a signalled run has to finish its step and write a checkpoint"""
    lora_rank: int = 0
    """LoRA adapters of this rank on lora_targets, base weights frozen (0 = off: train every weight; at most each target's min(in, out))"""
    lora_alpha: float = 0.0
    """LoRA scale numerator: the update is (alpha / rank) B A (0 = 2 x rank)"""
    lora_dropout: float = 0.0
    """dropout on the adapters' input, in [0, 1)"""
    lora_targets: str = ""
    """comma-separated projections of a block (model layout names, e.g. q_proj,v_proj); "" = attention's"""
    offload: str = "none"
    """none | optimizer: native ZeRO-1/2/3 keep the fp32 master shards and Adam state in host memory and run the optimizer step there (ZeRO-Offload) | optimizer-disk: the same in memory-mapped files under offload_dir (ZeRO-Infinity) | params: optimizer offload plus the parameter shards at rest on the host, copied to the device per unit for its all-gather (native ZeRO-3, ZeRO-Infinity offload_param; FSDP2: torch's CPUOffloadPolicy)"""
    offload_dir: str = ""
    """folder for train.offload = optimizer-disk (must exist and be writable; one rank-N subfolder per rank)"""
    meta_init: bool = False
    """build the model on the meta device and give storage and the dense init's values only to this rank's tensor-parallel slices of its pipeline stages (exact: same weights as a dense build; LoRA and model.init_from build densely); off by default until the 8-rank matrix chunks with it on have passed three times in a row (a heap corruption in a pooled 8-rank test process was seen once with it on; not reproduced, not explained)"""


@dataclass
class ParallelConfig:
    """Layout. ``dp = 0`` derives world_size / (tp * pp * cp). ``dp_impl``: native | torch.
    ``bucket_mb``: gradient bucket size in MiB. ``timeout_s``: collective timeout in seconds.
    ``zero_stage`` 0-3 over dp (``zero_impl`` native | fsdp2); ``reduce_dtype`` (auto | fp32 | bf16 |
    fp64; auto = fp32, or fp64 with train.dtype fp64): the dtype of every gradient collective -- dp
    reduction, tied and tp-replicated sums; bf16 needs zero_stage >= 1.
    ``tp``/``sequence_parallel``/``tp_impl`` (native | dtensor): tensor parallelism.
    ``pp``/``pp_schedule`` (naive | gpipe | 1f1b | interleaved | zb-h1 | zb-v)/``microbatches`` (per pipeline flush;
    0 = all of the step's micro-batches in one flush)/``virtual_stages``/``pp_split`` (auto = balanced
    over FLOP estimates counting embedding and head + loss, ``zerotron.parallel.pipeline.balance``;
    even (or "") = equal layer counts; or comma-separated layer counts per model stage)/``pp_impl``
    (native | threads: one process, ``virtual_stages`` worker threads running GPipe,
    ``zerotron.parallel.pipeline.threads`` | torch: torch.distributed.pipelining's schedules on the same
    split, ``zerotron.parallel.pipeline.torch_backend``): pipeline parallelism.
    ``find_unused_parameters``: torch DDP (``dp_impl = torch``) only: allow parameters without a
    gradient in a step (torch's extra graph traversal); native DDP and ZeRO always handle them.
    ``dp_replicate`` (HSDP): the dp group as replicas x shards; ZeRO shards within a shard group and
    all-reduces its gradient shard across replicas, native DDP all-reduces hierarchically.
    ``cp``/``cp_impl`` (ring | a2a | allgather): context parallelism -- the sequence of every
    micro-batch split over cp ranks (zigzag, ``zerotron.parallel.context``); losses and gradients
    are reduced over dp x cp and ZeRO/FSDP shard over dp_shard x cp."""

    dp: int = 0
    """data-parallel degree (0 = world_size / (tp * pp * cp))"""
    tp: int = 1
    """tensor-parallel degree (divides n_head)"""
    pp: int = 1
    """pipeline-parallel degree (stages)"""
    dp_replicate: int = 1
    """HSDP: dp = dp_replicate replicas x (dp / dp_replicate) shards (shard group innermost, inside a node)"""
    cp: int = 1
    """context-parallel degree: the sequence split over cp ranks (2*cp divides model.block_size)"""
    ep: int = 1
    """expert-parallel degree: each MoE layer's experts split over ep ranks carved out of dp (divides dp and model.n_experts)"""
    cp_impl: str = "ring"
    """context-parallel attention: ring (K/V blocks rotate, p2p) | a2a (Ulysses all-to-all; cp divides the kv heads per tp rank) | allgather (K/V all-gathered, Llama 3)"""
    dp_impl: str = "native"
    """native (bucketed all-reduce) | torch (torch DDP)"""
    bucket_mb: float = 25.0
    """gradient bucket size in MiB"""
    zero_stage: int = 0
    """ZeRO stage 0-3 over dp"""
    zero_impl: str = "native"
    """native | fsdp2 (torch fully_shard)"""
    reduce_dtype: str = "auto"
    """dtype of every gradient collective: auto | fp32 | bf16 | fp64 (auto = fp32, fp64 with train.dtype fp64)"""
    sequence_parallel: bool = False
    """shard layer-norm/dropout activations along the sequence over tp"""
    tp_impl: str = "native"
    """native | dtensor (torch DTensor TP, alone)"""
    pp_schedule: str = "1f1b"
    """naive | gpipe | 1f1b | interleaved | zb-h1 (zero bubble: split backward) | zb-v (zero bubble, two stages per rank in a V)"""
    microbatches: int = 0
    """micro-batches per pipeline flush (0 = all of the step's)"""
    virtual_stages: int = 1
    """model chunks per pipeline rank (interleaved schedule, >= 2; zb-v: 2; pp_impl = threads: the stage threads)"""
    pp_split: str = "auto"
    """layers per stage: auto (balanced by FLOP estimates, head + loss on the last stage) | even | counts, e.g. 3,5"""
    pp_impl: str = "native"
    """native (one process per stage) | threads (one process, virtual_stages stage threads, GPipe) | torch
    (torch.distributed.pipelining's schedules on the native split; pp x native DDP)"""
    find_unused_parameters: bool = False
    """torch DDP only: allow parameters without a gradient in a step (native DDP/ZeRO always do)"""
    backend: str = "auto"
    """auto | gloo | nccl"""
    timeout_s: float = 120.0
    """collective timeout in seconds: a dead or hung peer is reported after this (the token-cache
    wait has its own 30 min; raise this for checkpoint saves slower than it)"""


@dataclass
class CheckpointConfig:
    """``every``: save every N optimizer steps (0 = only at the end); ``keep``: newest N kept (0 = all)."""

    every: int = 0
    """save every N optimizer steps (0 = only at the end)"""
    keep: int = 2
    """newest N checkpoints kept (0 = all)"""
    save_final: bool = True
    """save a checkpoint after the last step"""
    on_error: str = "continue"
    """a save that fails or does not fit the free space: continue (default: training goes on and the next save retries, so a disk that fills for a while costs no work; the final save still exits 3) or stop (exit 3 at once)"""
    async_save: bool = False
    """periodic saves are staged into host memory and written by a background thread while training goes on (at most one in flight; the final save, a signal stop and the end of training wait for it)"""


@dataclass
class LogConfig:
    """Progress, plots, TensorBoard, W&B. ``every``: cadence of the plain progress line (stderr not a
    terminal); ``progress``: tqdm bar on rank 0 (a terminal) or those lines; ``sample_tokens``:
    length of the sample generated at the end (0 = none)."""

    every: int = 10
    """cadence in steps of the plain progress line when stderr is not a terminal"""
    progress: bool = True
    """progress on rank 0: a tqdm bar on a terminal, plain lines otherwise"""
    sample_tokens: int = 64
    """length of the sample generated at the end (0 = none; at most 100,000, as generate --max-new-tokens)"""
    sample_prompt: str = "ROMEO:"
    """prompt of that sample"""
    plot: bool = True
    """write loss.png in the run directory"""
    tensorboard: str = "auto"
    """TensorBoard event files in the run directory: auto (when the tensorboard package is installed) | true | false"""
    wandb: bool = False
    """also log the scalars to Weights & Biases, offline, under <run dir>/wandb (needs the wandb package)"""
    wandb_project: str = "zerotron"
    """W&B project name of the offline run (wandb sync uploads it there)"""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_cls(name: str):
    return {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "parallel": ParallelConfig,
            "checkpoint": CheckpointConfig, "log": LogConfig}[name]


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _default(section: str, name: str):
    """The default value of config field ``section.name``."""
    return next(f.default for f in dataclasses.fields(_section_cls(section)) if f.name == name)


def _coerce(section: str, name: str, typ, value, from_cli: bool = False):
    """Convert ``value`` to ``typ`` or raise ConfigError. CLI strings are parsed (an int field takes
    an integer literal: "1e3" and "1.0" are refused, as the floats they are in a TOML file); TOML
    values must already have the right type (an int is accepted for a float). Ranges are checked
    later (``config_checks.check_values``: every int within 64 bits, then each field's own bounds)."""
    key = f"{section}.{name}"
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(typ, typ) if isinstance(typ, str) else typ
    if from_cli and isinstance(value, str) and typ is not str:
        s = value.strip()
        if typ is bool:
            if s.lower() in ("true", "1", "yes", "on"):
                return True
            if s.lower() in ("false", "0", "no", "off"):
                return False
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        try:
            # an int field takes an integer literal only, as in a TOML file (where 1e3 is a float and
            # refused): "1e20" was read as int(1e20) and "1e3" as 1000
            return typ(s)
        except ValueError:
            hint = f" (an integer in digits, e.g. --{key} {_default(section, name)})" if typ is int else ""
            raise ConfigError(f"{key} must be {typ.__name__}, got {value!r}{hint}") from None
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        hint = f" (an integer in digits, e.g. {name} = {_default(section, name)})" if typ is int and \
            isinstance(value, float) else ""
        raise ConfigError(f"{key} must be {typ.__name__}, got {type(value).__name__} {value!r}{hint}")
    return value


@functools.cache
def _field_types(cls) -> dict:
    """{field name: type} of a config section's dataclass (cached: resolving the string
    annotations is the slow part of loading a config)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def apply(cfg: Config, section: str, name: str, value, from_cli: bool = False) -> None:
    """Set ``cfg.<section>.<name> = value`` with type checking; ConfigError for unknown keys."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}{_suggest(section, SECTIONS)}; "
                          f"valid sections: {', '.join(SECTIONS)}")
    types = _field_types(_section_cls(section))
    if name not in types:
        raise ConfigError(f"unknown config key {section}.{name}{_suggest(name, types)}; "
                          f"valid keys in [{section}]: {', '.join(types)}")
    obj = getattr(cfg, section)
    setattr(obj, name, _coerce(section, name, types[name], value, from_cli))
    obj.__dict__.setdefault("_given", set()).add(name)  # ModelConfig.given: set, even to the default


def _parse_toml(text: str) -> dict:
    """``tomllib.loads(text)``, a fresh copy each call, the parse cached by text (tests and the
    parity matrix build tens of thousands of configs from one file). Raises TOMLDecodeError."""
    return _fresh_copy(_parse_toml_cached(text))


def _fresh_copy(value):
    """A copy of parsed TOML: its tables (dicts) and arrays (lists) copied, at every depth, the
    immutable leaves (str, int, float, bool, dates and times) shared -- what ``copy.deepcopy``
    gives for this data, at a fraction of its cost."""
    if isinstance(value, dict):
        return {k: _fresh_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh_copy(v) for v in value]
    return value


@functools.lru_cache(maxsize=16)
def _parse_toml_cached(text: str) -> dict:
    return tomllib.loads(text)


def load_config(path: str | Path | None = None, overrides: list[tuple[str, str]] | None = None) -> Config:
    """Build a Config from defaults, then a TOML file, then ``(dotted_key, value)`` overrides.

    Raises ConfigError for a missing/unparsable file, unknown sections/keys, wrong types."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            what = "is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "not found"
            raise ConfigError(f"config file {str(p)!r} {what}; pass an existing TOML file to --config "
                              "(see configs/ for examples)")
        try:
            data = _parse_toml(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:  # TOML is UTF-8 (before: a traceback)
            raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {e.start}); pass a TOML file "
                              "saved as UTF-8 to --config") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {str(p)!r}: top-level key {section!r} must be a [section] table; "
                                  f"valid sections: {', '.join(SECTIONS)}")
            for name, value in values.items():
                apply(cfg, section, name, value)
    for key, value in overrides or []:
        if key.count(".") != 1:
            raise ConfigError(f"override --{key} must look like --section.field (e.g. --train.steps 10)")
        section, name = key.split(".")
        apply(cfg, section, name, value, from_cli=isinstance(value, str))
    return cfg


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``["--train.steps", "10", "--log.progress=false"]`` into ``[("train.steps", "10"), ...]``.

    Raises ConfigError for an argument that is not ``--section.field`` or lacks a value."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {a!r}; config overrides look like --section.field VALUE")
        if "=" in a:
            k, v = a[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a} needs a value (e.g. {a} 10)")
            k, v = a[2:], args[i + 1]
            i += 2
        out.append((k, v))
    return out


def model_shape(m: ModelConfig) -> dict:
    """Resolve the model family and sizes: set fields, then the preset, then the defaults (see
    :func:`zerotron.models.registry.resolve_shape`). Returns ``{"arch", "n_layer", "n_head",
    "n_embd", "block_size", "bias"}`` (+ ``vocab_size`` if the preset fixes one, + the llama fields).
    Raises ValueError (one line naming the field) for an unknown arch or preset or a field the
    family lacks."""
    from .models.registry import resolve_shape

    return resolve_shape(m)
