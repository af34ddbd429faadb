"""What a dry run builds for one rank (``analysis.dryrun``): the model config of a config's model
section (no tokenizer: the vocabulary is the preset's), the ranks traced by default, the synthetic
micro-batches the trainer would feed, and the rank's model, strategy and optimizer as
``train.trainer.Trainer`` builds them. Also what the real run of the same rank uses
(``bench.step_memory``), so both run the same rank on the same batches."""
from __future__ import annotations

import torch

from zerotron.analysis.flops import shape_of
from zerotron.config import ConfigError, model_shape
from zerotron.config_sections import Config


class DryRunError(ValueError):
    """Bad input to a dry run (unknown rank, a world size the layout does not fit, a config error):
    one line naming the problem and the fix."""


def model_config(cfg: Config):
    """The model config (GPTConfig / LlamaConfig) of ``cfg``'s model section; the vocabulary is
    model.vocab_size, else the preset's, else data.vocab_size (a dry run has no tokenizer).
    Raises DryRunError for an invalid model section."""
    from zerotron.models.registry import config_from_section

    try:
        shape = model_shape(cfg.model)
        vocab = cfg.model.vocab_size or shape.get("vocab_size") or cfg.data.vocab_size
        return config_from_section(cfg.model, vocab)
    except (ConfigError, ValueError) as e:
        raise DryRunError(str(e)) from None


def default_ranks(dims) -> list[int]:
    """One rank per distinct role of ``dims`` (``zerotron.dims.ParallelDims``): the first and the
    last pipeline stage at data-, context- and tensor-parallel coordinate 0. Tensor-parallel
    positions hold equal shards (the vocabulary-parallel rows are ceil(V/tp) on every tp rank) and dp
    positions equal flat shards, so they do not differ in traffic nor, but for one tensor, in memory:
    when V % tp != 0 the last tp rank's loss backward pads its gradient (4 sbV/tp bytes more at
    most, :func:`~zerotron.analysis.activations.loss_backward_bytes`; trace it with ``--rank``)."""
    return sorted({0, dims.peer(0, pp=dims.pp - 1)})


def synthetic_batches(n_micro: int, micro_batch: int, seq: int, vocab: int, seed: int = 0) -> list:
    """``n_micro`` micro-batches ``(x, y)`` of int64 token ids, each (micro_batch, seq), uniform in
    [0, vocab) (real tensors: a few KB per rank even for 8k-token sequences)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (micro_batch, seq), generator=g),
             torch.randint(0, vocab, (micro_batch, seq), generator=g)) for _ in range(n_micro)]


def rank_batches(cfg: Config, mesh, mcfg) -> list:
    """This rank's :func:`synthetic_batches` of one step as the trainer feeds them: global_batch /
    (dp x micro_batch) micro-batches of (micro_batch, block_size) token ids, cut to this cp rank's
    zigzag chunks (each (micro_batch, block_size / cp)) under context parallelism."""
    n_micro = cfg.train.global_batch // (mesh.size("dp") * cfg.train.micro_batch)
    batches = synthetic_batches(n_micro, cfg.train.micro_batch, mcfg.block_size, mcfg.vocab_size, cfg.train.seed)
    if mesh.size("cp") > 1:
        from zerotron.parallel.context.split import split_sequence

        cp, r = mesh.size("cp"), mesh.local_rank("cp")
        batches = [(split_sequence(x, cp, r), split_sequence(y, cp, r)) for x, y in batches]
    return batches


def _faking() -> bool:
    return type(torch.empty(0)).__name__ == "FakeTensor"


def build_rank(cfg: Config, plan, mesh):
    """(model config, strategy, optimizer) of this rank, as ``train.trainer.Trainer`` builds them:
    the model from ``train.seed`` in the parameter dtype -- on the meta device with ``train.meta_init``
    (``models.deferred``: ``parallelize`` materialises this rank's slices only), else dense -- then
    ``parallelize`` and the strategy's optimizer. Under a FakeTensorMode the model is built with the parameter dtype as
    the default dtype (``Module.to`` cannot swap fake parameters); for fp32 and bf16 training this
    is the same model."""
    from zerotron.models import registry
    from zerotron.parallel import parallelize
    from zerotron.parallel.precision import param_dtype

    mcfg = model_config(cfg)
    torch.manual_seed(cfg.train.seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(param_dtype(cfg.train.dtype))
    try:  # on the CPU (fake or real); Module.to cannot swap fake parameters
        if cfg.train.meta_init and not cfg.train.lora_rank and not _faking():  # as the trainer
            from zerotron.models.deferred import build_deferred

            model = build_deferred(lambda: registry.build_model(mcfg))
        else:  # (under fake tensors: densely, see models.deferred)
            model = registry.build_model(mcfg)
    finally:
        torch.set_default_dtype(before)
    strategy = parallelize(model, plan, mesh)
    optimizer = strategy.build_optimizer(cfg.train, strategy.decay_mask)
    return mcfg, strategy, optimizer


def largest_dense(cfg: Config) -> int:
    """Bytes of the largest tensor of the dense model (the (V, C) embedding or head), in the
    parameter dtype: what a deferred (meta-device) build materialises at once at most."""
    from zerotron.parallel.precision import param_dtype

    mcfg = model_config(cfg)
    s = shape_of(mcfg)
    big = max(s.vocab_size * s.n_embd, s.n_embd * max(s.ffn, s.n_embd), s.n_embd * (s.n_embd + 2 * s.kv_dim))
    return big * param_dtype(cfg.train.dtype).itemsize
