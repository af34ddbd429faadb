"""The training run: its set-up (process group, mesh, data, model, strategy, optimizer, a resumed
checkpoint), this rank's micro-batches and the end-of-run sample. The step loop is
``train.run_loop`` and the run's checkpoint saves ``train.run_saves``; :class:`Trainer` joins them."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import torch

from ..config import ConfigError
from ..config_sections import Config
from ..data import GlobalBatchSampler, batch_from_indices, num_windows
from ..distributed import comm
from ..distributed.mesh import Mesh, init_distributed
from ..models import registry
from ..models.moe import set_step_rows
from ..parallel import parallelize
from ..parallel.compile import use_cache_dir
from ..parallel.context.docmask import apply_doc_mask
from ..parallel.context.split import split_sequence
from ..parallel.precision import param_dtype
from ..plan import ParallelPlan, build_plan
from . import checkpoint as ckpt
from .checkpoint import background as ckpt_background
from .metrics import TRAIN_DTYPES, MFUMeter, peak_flops
from .optim import build_scheduler
from .run_loop import RunLoop
from .run_saves import RunSaves
from .setup import (
    check_init_vocab,
    check_resume,
    check_run_dir,
    eval_clip_note,
    gpt_config,
    load_data,
    pad_rows,
    padding_batch,
    train_device,
    val_rank_windows,
)
from .step import IGNORE_INDEX


class Trainer(RunLoop, RunSaves):
    """Owns one run. ``Trainer(cfg, run_dir, resume).fit()`` trains ``train.steps`` optimizer steps.

    ``restart`` (``restarts.restart_count()``): this is a restarted attempt of a run whose worker
    died; with ``resume`` it continues from the newest good checkpoint, without one it starts from
    step 0 and replaces the metrics (and TensorBoard events) the failed attempt wrote.

    ``plan`` (the ``ParallelPlan`` of ``cfg`` for this world size) and ``resume_from`` (the
    checkpoint directory ``train.setup.check_resume`` chose) are what ``zerotron train`` decided
    before anything was written; each process builds the plan and checks a resume once, there.
    A library caller may leave them out: the Trainer then builds and checks them itself. Raises
    ValueError for a plan of another world size.

    ``mesh``: a :class:`~zerotron.distributed.mesh.Mesh` of the plan's dims built earlier in this
    process group, whose process groups this run then uses instead of building its own (the parity
    matrix trains hundreds of layouts of a few mesh shapes in one spawn); None builds one. Raises
    ValueError for a mesh of other dims.

    Must run inside every worker process (torchrun/``--nproc``) or alone (world size 1)."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool = False, restart: int = 0,
                 plan: ParallelPlan | None = None, resume_from: Path | None = None, mesh: Mesh | None = None):
        self.cfg, self.run_dir, self.resume, self.restart = cfg, Path(run_dir), resume, restart
        if resume:  # ``zerotron train`` passes the verdict of its one check; a library caller gets it here
            self.resume_from = resume_from or check_resume(cfg, self.run_dir, quarantine=False)
        rank, world, device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, train_device(cfg))
        if not resume and not restart:  # a fresh run never writes over one (the CLI checks first too)
            self._refuse_existing_run(device)
        if plan is None:  # every layout rule, once per process: ``zerotron train`` built it before any write
            plan = build_plan(cfg, world)
        elif plan.dims.world_size != world:
            raise ValueError(f"the plan is for world size {plan.dims.world_size}, this process group has {world}")
        self.plan = plan  # the strategies take the plan
        self.layout = self.plan.layout()
        if mesh is not None and mesh.dims != self.plan.dims:
            raise ValueError(f"the mesh is for {mesh.dims}, the plan needs {self.plan.dims}")
        self.mesh = mesh if mesh is not None else Mesh(self.plan.dims, device)
        self.device, self.rank, self.world = device, rank, world
        self.dp_rank, self.dp = self.mesh.local_rank("dp"), self.mesh.size("dp")
        self.cp_rank, self.cp = self.mesh.local_rank("cp"), self.mesh.size("cp")
        self.data = load_data(cfg, int(os.environ.get("LOCAL_RANK", 0)))
        torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
        if cfg.model.init_from:
            self.model = self._from_hf(cfg.model.init_from).to(device)
            self.model_cfg = self.model.config
        else:
            self.model_cfg = gpt_config(cfg, self.data.vocab_size)
            if cfg.train.meta_init and not cfg.train.lora_rank:  # parallelize materialises this rank's part
                from ..models.deferred import build_deferred

                self.model = build_deferred(lambda: registry.build_model(self.model_cfg), device)
            else:
                self.model = registry.build_model(self.model_cfg).to(device)
        self.model.to(dtype=param_dtype(cfg.train.dtype))  # fp64 mode: every parameter in float64
        if cfg.train.lora_rank:  # base frozen, adapters trained (the plan checked the layout and targets)
            from ..models.lora import apply_lora, lora_kwargs

            apply_lora(self.model, registry.arch_of(self.model), **lora_kwargs(dataclasses.asdict(cfg.train)))
        self.seq_len = self.model_cfg.block_size
        self.num_params = self.model.num_params()  # dense count, before any sharding
        dense = self.model.state_dict()  # dense, before any sharding: what a checkpoint holds once
        self.state_bytes, self.state_tensors = sum(v.numel() * v.element_size() for v in dense.values()), len(dense)
        set_step_rows(self.model, cfg.train.global_batch, cfg.train.micro_batch)  # MoE: aux-loss weight b / global_batch, per micro-batch
        if cfg.train.compile:  # before the first compile: the ranks and a resumed run share Inductor's cache
            use_cache_dir(str(self.run_dir / "inductor_cache"))
        self.strategy = parallelize(self.model, self.plan, self.mesh)
        if cfg.data.doc_mask:  # outermost hooks; every runner wraps each micro-batch in its documents
            self.strategy.documents = apply_doc_mask(self.model, self.data.eot_id).documents
        self.optimizer = self.strategy.build_optimizer(cfg.train, self.strategy.decay_mask)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.sampler = GlobalBatchSampler(num_windows(len(self.data.train), self.seq_len),
                                          cfg.train.global_batch, cfg.train.seed)
        n_val = num_windows(len(self.data.val), self.seq_len)
        val_idx = GlobalBatchSampler.val_indices(n_val, cfg.train.eval_batches * cfg.train.global_batch)
        note = eval_clip_note(n_val, cfg.train.eval_batches, cfg.train.global_batch, self.seq_len)
        if note and rank == 0 and cfg.train.eval_every:  # clipped to the whole split: say so, once
            print(note, file=sys.stderr, flush=True)
        # the same number of eval forwards on every dp rank (padding batches count no token)
        val_groups = val_rank_windows(val_idx, self.dp_rank, self.dp, cfg.train.micro_batch)
        self.val_windows = np.concatenate(val_groups)  # this rank's windows, each once
        self.val_batches = [self._cp_local(batch_from_indices(self.data.val, g, self.seq_len, "val", self.data.val_mask,
                                                              IGNORE_INDEX) if len(g)
                                           else padding_batch(self.seq_len)) for g in val_groups]
        if cfg.train.compile:  # one static evaluation shape: no recompile for a short or padding batch
            self.val_batches = [pad_rows(b, cfg.train.micro_batch) for b in self.val_batches]
        self.start_step = 0
        self.failed_saves: list[int] = []  # steps whose checkpoint could not be written (on_error = continue)
        self.unsaved: int | None = None    # the newest of them, while no later save has succeeded
        self.ckpt_blocked_s = 0.0          # seconds the latest save blocked training
        self.saver = ckpt_background.AsyncSaver(self.strategy) if cfg.checkpoint.async_save else None  # collective
        torch.manual_seed(cfg.train.seed + 1 + rank)  # per-rank stream for dropout
        if resume:
            latest = self.resume_from
            meta = ckpt.load_checkpoint(latest, self.strategy, self.optimizer, self.scheduler)
            self.start_step = meta["step"]
            if rank == 0:
                again = f"restart {restart}: " if restart else ""
                print(f"zerotron: {again}resumed from {latest} (step {self.start_step})", flush=True)
                was = meta.get("config", {}).get("train", {}).get("steps")
                if was is not None and was != cfg.train.steps:
                    print(f"zerotron: train.steps {was} -> {cfg.train.steps}: the learning-rate schedule is "
                          "recomputed for the new length (not equal to an uninterrupted run)", flush=True)
            if meta.get("model_config", {}).get("vocab_size", self.model_cfg.vocab_size) != self.model_cfg.vocab_size:
                raise ConfigError("--resume: the vocabulary size differs from the checkpoint's; keep data.* and "
                                  "model.vocab_size as they were")
            # the LR of the next step from the *current* schedule (train.steps may have been raised)
            sch = self.scheduler
            for g, base, fn in zip(self.optimizer.param_groups, sch.base_lrs, sch.lr_lambdas):
                g["lr"] = base * fn(sch.last_epoch)
        from ..analysis.flops import shape_of, training_flops_per_token

        # N of 6N: the matmul parameters (an untied Llama embedding is a lookup; GPT-2: num_params)
        self.flops_per_token = training_flops_per_token(shape_of(self.model_cfg).flop_params(),
                                                        self.model_cfg.n_layer, self.model_cfg.n_embd, self.seq_len)
        local_peak, source = peak_flops(device, TRAIN_DTYPES[cfg.train.dtype])  # cached per process
        peak = torch.tensor([local_peak], dtype=torch.float64, device=device)
        comm.all_reduce(peak, tag="setup")
        self.peak_flops_total = float(peak)
        self.mfu_meter = MFUMeter(self.flops_per_token, world, self.peak_flops_total / world, device,
                                  TRAIN_DTYPES[cfg.train.dtype], warn=rank == 0, source=source)

    def _from_hf(self, path):
        """Dense model with the family, shape and weights of a HF GPT-2 or Llama checkpoint
        (dropout from the config). Raises ConfigError if its vocabulary is smaller than the
        tokenizer's."""
        hf = registry.load_hf(path)
        check_init_vocab(hf.config.vocab_size, self.data.vocab_size)
        model = registry.build_model(dataclasses.replace(hf.config, dropout=self.cfg.model.dropout))
        model.load_state_dict(hf.state_dict())
        return model

    def _cp_local(self, batch):
        """This cp rank's part of a batch ``(x, y)``: both (b, T) -> (b, T / cp), the zigzag chunks
        of ``parallel.context.split`` (the targets of the local tokens; unchanged without cp)."""
        x, y = batch
        return split_sequence(x, self.cp, self.cp_rank), split_sequence(y, self.cp, self.cp_rank)

    def _chunks(self, indices, tokens, mask=None):
        mb = self.cfg.train.micro_batch
        return [self._cp_local(batch_from_indices(tokens, indices[i:i + mb], self.seq_len, "train", mask, IGNORE_INDEX))
                for i in range(0, len(indices), mb)]

    def micro_batches(self, step: int):
        """This rank's micro-batches of optimizer step ``step``: list of (x, y), each (micro_batch, T)
        (T / cp: this cp rank's zigzag chunks under context parallelism)."""
        return self._chunks(self.sampler.local_indices(step, self.dp_rank, self.dp), self.data.train,
                            self.data.train_mask)

    def meta(self, step: int) -> dict:
        return {"config": self.cfg.to_dict(), "world_size": self.world, "layout": self.layout,
                "tokens_seen": step * self.cfg.train.global_batch * self.seq_len,
                "model_config": registry.config_meta(self.model_cfg)}

    def _refuse_existing_run(self, device) -> None:
        """ConfigError on every rank if ``run_dir`` already holds a run (metrics or checkpoints).
        The verdict is all-reduced before any rank writes, so no rank can see a file another rank
        of this run just created, and all ranks stop together."""
        try:
            check_run_dir(self.run_dir, False)
            found = None
        except ConfigError as e:
            found = e
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            flag = torch.tensor([0.0 if found is None else 1.0], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() and found is None:
                found = ConfigError(f"run directory {str(self.run_dir)!r} already holds a run on another rank; "
                                    "pass resume=True to continue it, or choose a new run directory")
        if found is not None:
            raise found

    def sample(self, prompt: str, n: int) -> str:
        """Decode ``n`` tokens after ``prompt`` (temperature 0.8, top-k 50, fixed seed)."""
        ids = self.data.tokenizer.encode(prompt).ids or [self.data.eot_id]
        idx = torch.tensor([ids], device=self.device)
        self.model.eval()
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed)
        with self.strategy.full_params() as model:
            out = model.generate(idx, n, temperature=0.8, top_k=50, generator=gen)
        self.model.train()
        return self.data.tokenizer.decode(out[0].tolist())
