"""The configuration's sections: one dataclass per TOML table (``[model]``, ``[data]``, ``[train]``,
``[parallel]``, ``[checkpoint]``, ``[log]``) and :class:`Config`, which holds one of each.

Each field is followed by its attribute docstring (``zerotron train --help`` shows it:
:mod:`zerotron.config_doc`). Values are read and type-checked by :mod:`zerotron.config`
(:func:`~zerotron.config.load_config`) and checked in one place, :func:`zerotron.plan.build_plan`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .fields import field_defaults


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
        """True if field ``name`` was set from a TOML file or the command line (:func:`zerotron.config.apply`), or
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
    """A whole configuration: one of each section (``cfg.model``, ``cfg.data``, ``cfg.train``,
    ``cfg.parallel``, ``cfg.checkpoint``, ``cfg.log``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config)}
"""``{section name: its dataclass}`` in declaration order (``{"model": ModelConfig, ...}``)"""
