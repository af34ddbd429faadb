"""Dry runs at cluster scale: one training step of one rank of a large layout, traced in this
process with fake tensors and the fake process group (issue 33).

For a config and a world size (up to thousands of ranks) :func:`dry_run` runs, for each traced
rank, the *real* zerotron code of a training step -- ``parallelize`` (tensor parallel, activation
checkpointing, the pipeline runner, the gradient synchroniser), forward and backward over the
rank's micro-batches, ``finish_grads``, the grad-norm clip, the optimizer step -- with

* ``torch._subclasses.FakeTensorMode``: tensors with shapes, dtypes and storages of the right size
  but no memory, so a 70B model costs the process a few hundred MB;
* torch's ``fake`` process-group backend (``torch.testing._internal.distributed.fake_pg``): the
  default group is created with ``rank = R`` and ``world_size = N``, so the DeviceMesh, every
  zerotron group and every collective are those of rank R; collectives return at once and move no
  data, but go through ``zerotron.distributed.comm``, which counts them (``comm.STATS``);
* a ``torch.distributed._tools.MemTracker`` (a dispatch mode counting the bytes of every live
  storage by category: parameters, gradients, optimizer state, activations, temporaries of the
  backward, other) whose peak is the step's peak memory, with the moment it happened (step phase,
  innermost module, forward or backward).

Values read back from fake tensors (``.item()``: the loss, the grad norm, token counts) are 1: the
dry run traces shapes and traffic, not numerics. The token ids are synthetic (uniform over the
preset's vocabulary, no corpus or tokenizer). Two steps run: the first creates the optimizer state
(lazily, as AdamW does), the second is the one measured (memory and traffic of a steady step).

Beside each traced figure the record holds the estimators' figure for the same rank and layout:
model states (:func:`zerotron.analysis.memory.model_state_bytes` on
:func:`~zerotron.analysis.memory.stage_num_params`) + activations
(:func:`zerotron.analysis.activations.activation_bytes`), and the collective bytes the planner
prices (:func:`zerotron.analysis.planner.comm_bytes`), per group.

This module imports ``parallel`` (the code it traces) but not ``train`` (``train`` imports
``analysis``); the step below is ``train.step.train_step`` without the LR scheduler and the
non-finite guard, the same strategy calls in the same order.
"""
from __future__ import annotations

import contextlib
import resource
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from zerotron.analysis.activations import LOSS_BYTES, activation_bytes, looped_counts, stage_layer_counts
from zerotron.analysis.flops import shape_of
from zerotron.analysis.memory import model_state_bytes, stage_num_params
from zerotron.analysis.trace_time import StepCounter, group_scopes, rank_time, step_time
from zerotron.config import Config, ConfigError, model_shape

__all__ = ["DryRunError", "default_ranks", "dry_run", "predict_step_time", "estimate", "build_rank", "rank_batches", "synthetic_batches",
           "CATEGORIES"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "other")
"""Memory categories of a record (MemTracker's Parameter, Gradient, Optstate, Activation, Temp;
Buffer and Other together as "other")."""


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


# ---- memory tracking ---------------------------------------------------------------------------

def _scalar(t: torch.Tensor):
    """The stand-in for a value read back from a fake tensor (the dry run traces no numerics)."""
    if t.dtype == torch.bool:
        return True
    return 1.0 if t.dtype.is_floating_point or t.dtype.is_complex else 1


def _released_once_fired(original):
    """``torch.autograd.graph.register_multi_grad_hook`` whose hooks remove themselves at the end of
    the backward that fired them. ModTracker (inside MemTracker) registers one on every module's
    inputs; in mode "all" its closure keeps the inputs' gradient nodes, and for a leaf input (a
    pipeline stage's received activation, made to require grad) that node is the leaf's
    AccumulateGrad, which owns the leaf: leaf -> its hooks -> closure -> AccumulateGrad -> leaf, a
    cycle through autograd's C++ node that Python's collector cannot break. The leaf and its .grad
    then outlived the step in every dry run of a pipeline stage > 0 (the last stage of Llama-3-8B
    at 8 micro-batches: 2 x 1 GiB, 8 inputs and 8 input gradients of (1, 8192, 4096) fp32), which a
    real run, without the tracker, does not hold."""
    def register(tensors, fn, *, mode="all"):
        handle = None

        def once(*args):
            fn(*args)
            torch.autograd.Variable._execution_engine.queue_callback(handle.remove)

        handle = original(tensors, once, mode=mode)
        return handle

    return register


def _tracker_class():
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        """MemTracker that answers ``.item()`` on fake tensors (:func:`_scalar`), records the moment
        of the peak (``phase`` set by the driver, innermost module, forward/backward) and the first
        moment the total exceeds ``limit`` bytes (with the category that grew)."""

        def __init__(self, limit: int | None = None):
            super().__init__()
            self.phase, self.limit, self.peak_at, self.oom, self._last = "setup", limit, None, None, None
            self._seen = weakref.WeakSet()

        def __enter__(self):
            if self._depth == 0:  # see _released_once_fired
                self._multi_grad_hook = mod_tracker.register_multi_grad_hook
                mod_tracker.register_multi_grad_hook = _released_once_fired(self._multi_grad_hook)
            return super().__enter__()

        def __exit__(self, *args):
            super().__exit__(*args)
            if self._depth == 0:
                mod_tracker.register_multi_grad_hook = self._multi_grad_hook

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return _scalar(args[0])
            return super().__torch_dispatch__(func, types, args, kwargs)

        def moment(self) -> dict:
            mods = [m for m in self._mod_tracker.parents if m != "Global"]
            return {"phase": self.phase, "module": max(mods, key=lambda m: (m.count("."), m)) if mods else None,
                    "pass": "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"}

        # module hooks: label each module's parameters (and gradient hooks) once, and mark the
        # recomputation region (a forward inside the backward); no per-module snapshots (MemTracker's
        # refuse a module called twice: micro-batches, pipeline chunks)
        def _pre_fw_hook(self, module, inputs) -> None:
            if module not in self._seen:
                self._seen.add(module)
                self._track_module_params_and_buffers(module, install_grad_hooks=True)
            elif self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _post_fw_hook(self, module, inputs, outputs) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def _pre_bw_hook(self, module, args) -> None:
            pass

        def _post_bw_hook(self, module, args) -> None:
            pass

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_at = self.moment()
            if self.limit is not None and self.oom is None:
                now = _categories(self._curr_mem_snap)
                if now["total"] > self.limit:
                    last = self._last or dict.fromkeys(now, 0)
                    grew = max(CATEGORIES, key=lambda c: now[c] - last[c])
                    self.oom = {**self.moment(), "category": grew, "total_bytes": now["total"], "categories": now}
                self._last = now

        def categorize(self, t, kind: str) -> None:
            if t is not None and t.untyped_storage().nbytes():
                self._update_and_maybe_create_winfos(t, getattr(_MemRefType, kind))

    return Tracker


def _categories(snap: dict) -> dict:
    """Bytes per category of a MemTracker snapshot ({device: {reftype: bytes}}), summed over devices
    (the meta device left out)."""
    out = dict.fromkeys(CATEGORIES, 0)
    names = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer", "Activation": "activations",
             "Temp": "temporary", "Buffer": "other", "Other": "other"}
    total = 0
    for device, dev in snap.items():
        if getattr(device, "type", device) == "meta":  # a deferred-init model's shapes: no memory
            continue
        for k, v in dev.items():
            key = getattr(k, "value", k)
            if key == "Total":
                total += v
            else:
                out[names[key]] += v
    out["total"] = total
    return out


def _categorize(tracker, strategy, optimizer) -> None:
    """Label the storages of the model states, as ``Strategy.model_state_bytes`` counts them:
    ZeRO flat buffers as ``flat_state_bytes`` (compute copy = parameters; fp32 master = optimizer
    state, or parameters for stage 3 without a compute copy; full and shard gradients), otherwise
    the module's parameters, their ``.grad``, the optimizer's own parameters (master copies) and
    its state tensors."""
    zero = getattr(strategy, "zero", None) or strategy
    flats = getattr(zero, "all_flats", None)
    for st in optimizer.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                tracker.categorize(t, "OPT")
    for g in optimizer.param_groups:
        for p in g["params"]:
            tracker.categorize(p, "OPT")
            tracker.categorize(p.grad, "GRAD")
    if flats:
        for f in flats:
            if f.stage == 3 and f.compute_dtype == f.master_dtype:
                tracker.categorize(f.master, "PARAM")
            tracker.categorize(f.grad_full, "GRAD")
            tracker.categorize(f.shard_grad, "GRAD")
    for p in strategy.module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        tracker.categorize(local, "PARAM")
        if p.grad is not None:
            tracker.categorize(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, "GRAD")
    if flats:
        for f in flats:
            tracker.categorize(f.full, "PARAM")


def _largest_dense(cfg: Config) -> int:
    """Bytes of the largest tensor of the dense model (the (V, C) embedding or head), in the
    parameter dtype: what a deferred (meta-device) build materialises at once at most."""
    from zerotron.parallel.precision import param_dtype

    mcfg = model_config(cfg)
    s = shape_of(mcfg)
    big = max(s.vocab_size * s.n_embd, s.n_embd * max(s.ffn, s.n_embd), s.n_embd * (s.n_embd + 2 * s.kv_dim))
    return big * param_dtype(cfg.train.dtype).itemsize


# ---- one traced rank -----------------------------------------------------------------------------

def _step(strategy, optimizer, batches, batch_group, tcfg, device, tracker) -> None:
    """``train.step.train_step`` without scheduler and guard: the token count all-reduce, then
    forward/backward, finish_grads, clip, loss reduction, optimizer step (``tracker.phase`` set
    before each)."""
    from zerotron.distributed import comm

    tracker.phase = "loss_norm"
    t = torch.tensor([float(sum(y.numel() for _, y in batches))], dtype=torch.float64)
    comm.all_reduce(t, group=batch_group, tag="loss_norm")
    n_global = int(sum(y.numel() for _, y in batches)) * max(1, batch_group.size() if batch_group else 1)
    tracker.phase = "zero_grad"
    strategy.zero_grad()
    tracker.phase = "forward_backward"
    loss_sum = strategy.forward_backward(batches, n_global, tcfg.dtype, device)
    tracker.phase = "finish_grads"
    strategy.finish_grads()
    tracker.phase = "clip_grad_norm"
    strategy.clip_grad_norm(tcfg.grad_clip)
    tracker.phase = "reduce_loss"
    strategy.reduce_loss(loss_sum)
    tracker.phase = "optimizer_step"
    strategy.optimizer_step(optimizer)


def _comm_by_group(stats) -> dict:
    """``{group: {"bytes", "calls", "ops": {"op/tag": {"calls", "bytes"}}}}`` from ``comm.STATS``
    (bytes in its nccl-tests size convention)."""
    out: dict = {}
    for (op, group, tag), b in sorted(stats.bytes.items()):
        g = out.setdefault(group, {"bytes": 0, "calls": 0, "ops": {}})
        calls = stats.calls[(op, group, tag)]
        g["bytes"] += b
        g["calls"] += calls
        g["ops"][f"{op}/{tag}"] = {"calls": calls, "bytes": b}
    return dict(sorted(out.items()))


class _Done:
    """A fake-backend point-to-point ``Work`` that says it is complete once posted. The fake
    backend moves nothing, so it is; but torch's ``FakeWork.is_completed()`` answers False forever,
    and the pipeline's poster (``pipeline.p2p.CommRunPoster``), which drops a send's tensor once
    its Work is complete, then kept every gradient the last stage sent until the end of the walk
    (7 of Llama-3-8B's 8 micro-batches at the loss's backward: 7 x 128 MiB)."""

    def __init__(self, work):
        self.work = work

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def _p2p_completes_at_once():
    """``torch.distributed.batch_isend_irecv`` returns :class:`_Done` works while the context is
    active (the pipeline's path on a backend other than gloo, the fake one included; isend/irecv
    stay: ``P2POp`` checks their identity)."""
    import torch.distributed as dist

    batch = dist.batch_isend_irecv

    def done(*args, **kwargs):
        return [_Done(w) for w in batch(*args, **kwargs)]

    dist.batch_isend_irecv = done
    try:
        yield
    finally:
        dist.batch_isend_irecv = batch


def _not_dispatched(module) -> int:
    """Bytes a rank holds in tensors that no operator made, which a tracker of dispatched operators
    cannot see: the tensor-parallel RNG tracker's generator states (``torch.Generator.get_state``,
    5,056 bytes each on CPU; ``parallel.tensor.transform.RNGStatesTracker``). They live through the
    whole step (a ``fork`` replaces one by its successor and, while it runs, holds the outer
    generator's state too: at most two states more, inside a dropout)."""
    from zerotron.parallel.tensor.transform import find_rng_tracker

    rng = find_rng_tracker(module)
    return sum(t.untyped_storage().nbytes() for t in rng.states.values()) if rng is not None else 0


@contextlib.contextmanager
def _code_paths_of(backend: str):
    """While active, the fake process groups answer ``torch.distributed.get_backend`` with
    ``backend``, so code that picks its path by the backend takes the path of the backend the plan
    names (``parallel.backend``; "auto" traces NCCL's: a dry run predicts a GPU job). The one such
    path of a training step is the pipeline's (``pipeline.p2p.CommRunPoster``): on gloo it posts
    sends and receives one by one and the next comm run's receives early (one more message buffer
    in flight per direction); elsewhere one ``batch_isend_irecv`` per run. A gloo send reports
    completion only once waited (``Work.is_completed()`` stays False after the peer has received
    it; torch 2.13, checked), so on gloo the poster holds every send of a walk until
    ``finish_walk``: the fake backend's sends, which never say complete, are held the same way."""
    import torch.distributed as dist

    saved = dist.get_backend
    if backend == "gloo":
        dist.get_backend = lambda group=None: backend
    try:
        yield
    finally:
        dist.get_backend = saved


def _trace_rank(cfg: Config, plan, rank: int, gpu_mem: int | None, steps: int = 2) -> dict:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerotron.distributed import comm
    from zerotron.distributed.mesh import Mesh

    dims = plan.dims
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    tracker = _tracker_class()(None)  # the limit applies from the measured step on
    try:
        device = torch.device("cpu")
        mesh = Mesh(dims, device)
        mcfg = model_config(cfg)
        batches = rank_batches(cfg, mesh, mcfg)
        backend = plan.backend if plan.backend != "auto" else "nccl"
        with warnings.catch_warnings(), _p2p_completes_at_once(), _code_paths_of(backend), \
                FakeTensorMode(allow_non_fake_inputs=True), tracker:
            # MemTracker's gradient hook meets parameters whose .grad the synchroniser cleared
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            _, strategy, optimizer = build_rank(cfg, plan, mesh)
            setup = _categories(tracker.get_tracker_snapshot("peak"))
            # with train.meta_init a real rank's construction holds what it keeps plus one full tensor
            held_after_setup = _categories(tracker.get_tracker_snapshot("current"))["total"]
            largest = _largest_dense(cfg)
            for i in range(steps):
                if i == steps - 1:  # the measured step: every state exists and is labelled
                    _categorize(tracker, strategy, optimizer)
                    tracker._peak_mem = {}
                    tracker._peak_mem_snap = {}
                    tracker.peak_at, tracker.limit, tracker._last = None, gpu_mem, None
                    held = _categories(tracker.get_tracker_snapshot("current"))
                    if gpu_mem is not None and held["total"] > gpu_mem:  # the states alone do not fit
                        tracker.oom = {"phase": "model states", "module": None, "pass": None, "total_bytes": held["total"],
                                       "category": max(CATEGORIES, key=lambda c: held[c]), "categories": held}
                    comm.STATS.reset()
                    with StepCounter() as counter:
                        _step(strategy, optimizer, batches, mesh.group("batch"), cfg.train, device, tracker)
                else:
                    _step(strategy, optimizer, batches, mesh.group("batch"), cfg.train, device, tracker)
            _categorize(tracker, strategy, optimizer)
            peak = _categories(tracker.get_tracker_snapshot("peak"))
            end = _categories(tracker.get_tracker_snapshot("current"))
            states = strategy.model_state_bytes(optimizer)
            split = list(getattr(strategy, "split", None) or []) or None  # the pipeline runner's layers per stage
            for snap, key in ((peak, "total"), (end, "total")):  # what no operator made (see _not_dispatched)
                snap["other"] += (extra := _not_dispatched(strategy.module))
                snap[key] += extra
            held["total"] += extra
        traffic = _comm_by_group(comm.STATS)
        coords = {k: v for k, v in mesh.coords.items()}
        members = {g: list(comm.STATS.members[g]) for g in traffic}
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "coords": coords, "peak_bytes_traced": peak["total"], "peak_traced": peak,
            "peak_at": tracker.peak_at, "end_of_step": end, "held_at_step_start": held["total"],
            "setup_peak_bytes": setup["total"],
            "model_state_bytes": states, "comm_traced": traffic,
            "comm_bytes_traced": {g: v["bytes"] for g, v in traffic.items()},
            "oom": tracker.oom, "layer_counts": split, "meta_init": bool(cfg.train.meta_init and not cfg.train.lora_rank),
            "construction_bytes": held_after_setup + largest, "group_members": members,
            "counts_traced": {"flops": counter.flops, "element_passes": counter.element_passes, "ops": counter.ops,
                              "flops_by_op": dict(sorted(counter.flops_by_op.items()))},
            "flops_traced": counter.flops, "wall_s": time.perf_counter() - t0}


# ---- estimators ----------------------------------------------------------------------------------

_MEM_DTYPE = {"fp32": "fp32", "bf16": "bf16-mixed", "fp64": "fp64"}
_ACT_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp64": "fp32"}


@dataclass(frozen=True)
class _Layout:
    dp: int
    tp: int
    pp: int
    dp_replicate: int
    zero_stage: int
    schedule: str
    microbatches: int
    virtual_stages: int
    micro_batch: int
    seq: int
    recompute: str
    sp: bool
    dtype: str


def _layout(cfg: Config, plan, mcfg) -> _Layout:
    p = cfg.parallel
    dims = plan.dims
    schedule = p.pp_schedule if dims.pp > 1 else "1f1b"
    v = p.virtual_stages if schedule in ("interleaved", "zb-v") else 1
    n_micro = cfg.train.global_batch // (dims.size("dp") * cfg.train.micro_batch)
    return _Layout(dims.size("dp"), dims.tp, dims.pp, p.dp_replicate, p.zero_stage, schedule,
                   p.microbatches or n_micro, v, cfg.train.micro_batch, mcfg.block_size,
                   cfg.train.activation_checkpointing, bool(p.sequence_parallel) and dims.tp > 1, cfg.train.dtype)


def estimate(cfg: Config, plan, pp_rank: int, layer_counts: list[int] | None = None, tp_rank: int = 0) -> dict:
    """What the estimators compute for pipeline rank ``pp_rank`` (tensor-parallel rank ``tp_rank``)
    of ``cfg``'s layout, at the moment of its peak: ``{"model_states": {params_bytes, grads_bytes, optimizer_bytes,
    total_bytes} (:func:`~zerotron.analysis.memory.model_state_bytes`), "activations" (saved, of
    the schedule's micro-batches in flight: :func:`~zerotron.analysis.activations.activation_bytes`,
    autocast's dtypes in bf16), "terms": {...}, "total"}``; ``terms`` are what the code allocates
    beside them at the peak (the last stage's is the loss's backward, the others' a backward with
    every in-flight micro-batch held), each derived from the code and measured:

    * ``zero1_fp32_grad``: native ZeRO-1 in bf16 keeps an fp32 shard gradient (4 bytes per shard
      element) beside the bf16 full gradient (the paper's 2 + 2 + 12 omits it);
    * ``weight_casts``: autocast over fp32 parameters (bf16 with DDP or tp/pp without ZeRO) casts
      every matmul weight to bf16 in each forward and the Linears keep the copies until their
      backward: 2 bytes per local matmul parameter and micro-batch in flight (full recomputation:
      only the head's, the blocks' are dropped with their saved tensors);
    * ``stage_outputs``: a pipeline stage keeps each in-flight micro-batch's output (b, s, h) in the
      stream's dtype until its backward, and receives one gradient of that size;
    * ``stage_inputs``: a stage after the first keeps each in-flight micro-batch's received input
      (the executor's saved (input, output) pair) until its backward, and one input gradient
      it sent until its next comm run (1F1B's last stage: the micro-batch in backward and the
      previous one's gradient, 2 (b, s, h));
    * ``loss_backward``: :func:`~zerotron.analysis.activations.loss_backward_bytes` (last stage);
    * ``gathered``: native ZeRO-3 holds the last stage's root unit (embedding, final norm, head)
      gathered in the compute dtype during the loss's backward; FSDP2 does not: it reshards the
      root after the forward too (zerotron passes ``reshard_after_forward`` explicitly, which
      turns off torch's keep-the-root-gathered default) and gathers it again at the root's
      backward, after the loss's (MemTracker sees the gathers: FSDP2 resizes their storages
      through ``UntypedStorage.resize_``, which the tracker follows);
    * ``fsdp2_no_grads``: FSDP2 frees its gradients between steps (set to None), so none exist at
      the loss's backward (negative); they are shards of its sharded parameters, in the parameter
      dtype (fp32 under bf16 autocast: 4 bytes per shard element where the bf16-mixed states
      count 2; FSDP2's fp32 parameter shard and Adam's two moments make up the same 16 bytes);
    * ``finish_grads_moment`` (native ZeRO-1): after the backward, ``finish_grads`` reduce-scatters
      unit by unit, at most ``ZeroSync.reduce_window`` (2) units in flight, each holding its
      gradient cast to ``reduce_dtype`` (when it differs from the gradient's) and its output
      shard; the largest neighbouring units are the root unit (embedding / head) and blocks.
      When that moment (model states + those buffers) exceeds the backward's, the difference
      (0 otherwise; a pipeline's first stage under full recomputation, where little is held);
    * ``block_backward`` (a stage without the head, whose peak is a block's backward): what that
      backward holds beyond the block's saved tensors at its worst moment
      (:func:`~zerotron.analysis.activations.block_backward_bytes`: the SwiGLU backward, or
      RMSNorm's composite fp32 backward);
    * ``fsdp2_last_block_moment`` (FSDP2, one micro-batch, no pipeline): when the backward of the
      last block it reaches (:func:`_fsdp2_last_block_bytes`: the gradient shards of the blocks
      done, the reduce-scatter and all-gather buffers, the gathered root and the head's unsharded
      gradient) exceeds the loss's moment, the difference (0 otherwise; full recomputation at
      Llama-3-70B's size, where the activations are small beside 4 bytes per shard element);
    * with recomputation, on the last stage: the loss's backward (the peak) comes before any layer
      is recomputed, so the recompute workspace is not live then (``recompute_workspace_not_live``,
      negative); ``recompute_moment`` adds the difference when the first recomputation's backward
      (workspace and ``block_backward`` live, the loss's tensors freed) is the larger moment.

    fp64 training: activations counted at fp32's 4 bytes (the estimator has no 8-byte activations).
    ``layer_counts``: layers per model stage as the pipeline runner split them (its ``split``),
    None = the estimators' even split. Attention "flash" (CPU SDPA without dropout)."""
    from zerotron.analysis.activations import block_backward_bytes, loss_backward_bytes

    mcfg = model_config(cfg)
    lay = _layout(cfg, plan, mcfg)
    shape = shape_of(mcfg)
    split = list(layer_counts) if layer_counts else stage_layer_counts(shape.n_layer, lay.pp * lay.virtual_stages)
    counts = looped_counts(split, lay.pp, lay.schedule)
    params = stage_num_params(shape, lay.tp, lay.pp, lay.virtual_stages, counts)[pp_rank]
    cp = plan.dims.cp  # context parallel: states sharded over dp x cp, each rank seq / cp tokens
    states = model_state_bytes(params, lay.dp * cp, lay.zero_stage, _MEM_DTYPE[lay.dtype], "adam", lay.dp_replicate)
    bf16 = lay.dtype == "bf16"
    bf16_params = bf16 and lay.zero_stage >= 1  # ZeRO's compute copies, FSDP2's param dtype
    seq = lay.seq // cp
    act = activation_bytes(shape, lay.micro_batch, seq, tp=lay.tp, sp=lay.sp, pp=lay.pp, schedule=lay.schedule,
                           microbatches=lay.microbatches, virtual_stages=lay.virtual_stages,
                           recompute=lay.recompute, dtype=_ACT_DTYPE[lay.dtype], attention="flash",
                           dropout=cfg.model.dropout > 0, layer_counts=layer_counts, autocast=bf16,
                           bf16_params=bf16_params)
    a = act["per_rank_bytes"][pp_rank]
    last = pp_rank == plan.placement.last_rank if lay.pp > 1 else True
    layers = sum(counts[c * lay.pp + pp_rank] for c in range(lay.virtual_stages))
    flight = act["peak_in_flight"][pp_rank] if lay.pp > 1 else 1
    fsdp2 = cfg.parallel.zero_impl == "fsdp2" and lay.zero_stage >= 2
    V, h, t = shape.vocab_size, shape.n_embd, lay.tp
    head = -(-V // t) * h if last else 0  # the output head's local matmul weight
    e = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    r = 4 if bf16 and not bf16_params else e  # residual stream bytes
    sbh = seq * lay.micro_batch * h // (t if lay.sp else 1)
    terms = {"zero1_fp32_grad": 4 * -(-params // (lay.dp * cp // lay.dp_replicate))
             if bf16 and lay.zero_stage == 1 and not fsdp2 else 0,
             "weight_casts": 0, "stage_outputs": 0, "stage_inputs": 0, "loss_backward": 0, "gathered": 0,
             "fsdp2_no_grads": -(2 if bf16 else 1) * states["grads_bytes"] if fsdp2 and last else 0}
    if bf16 and not bf16_params:
        blocks = layers * shape.block_matmul_params() // t
        terms["weight_casts"] = 2 * (head + (blocks * flight if lay.recompute != "full" else 0))
    if lay.pp > 1 and not last:
        terms["stage_outputs"] = (flight + 1) * r * sbh
    if lay.pp > 1 and (pp_rank > 0 or lay.virtual_stages > 1):
        terms["stage_inputs"] = (flight + 1) * r * sbh
    if last:
        terms["loss_backward"] = loss_backward_bytes(seq, lay.micro_batch, V, t, bf16, e, tp_rank)
        if lay.zero_stage == 3 and not fsdp2:
            root = params - layers * shape.block_params(t)
            terms["gathered"] = (2 if bf16 else e) * root
    bwd = block_backward_bytes(shape, seq, lay.micro_batch, t, lay.sp, _ACT_DTYPE[lay.dtype], bf16, bf16_params)
    if not last:  # the peak is a block's backward
        terms["block_backward"] = bwd
    if last and lay.recompute != "none":  # the loss's backward comes before any layer is recomputed:
        loss_moment = terms["loss_backward"] + terms["gathered"] - act["recompute_workspace_bytes"]
        loss_saved = LOSS_BYTES * seq * lay.micro_batch * -(-V // t)  # freed once the loss's backward is done
        terms["recompute_moment"] = max(0, bwd - loss_saved - loss_moment)  # (the later moment, if larger)
        terms["recompute_workspace_not_live"] = -act["recompute_workspace_bytes"]
    if fsdp2 and lay.pp == 1 and lay.microbatches == 1:  # the step's other moment: the last block's backward
        later = _fsdp2_last_block_bytes(cfg, lay, shape, states, act, params, layers, cp)
        terms["fsdp2_last_block_moment"] = max(0, later - states["total_bytes"] - a - sum(terms.values()))
    total = states["total_bytes"] + a + sum(terms.values())
    if lay.zero_stage == 1 and not fsdp2:  # the step's other moment: finish_grads' reduce-scatters
        from zerotron.parallel.data.zero import ZeroSync
        from zerotron.parallel.precision import reduce_dtype

        red = reduce_dtype(lay.dtype, cfg.parallel.reduce_dtype).itemsize
        n, block = ZeroSync.reduce_window, shape.block_params(t)
        units = max(params - layers * block + (n - 1) * block, n * block) if layers else params  # largest neighbours
        shards = lay.dp * cp // lay.dp_replicate
        window = (red if red != (2 if bf16 else e) else 0) * units + red * -(-units // shards)
        finish = states["total_bytes"] + terms["zero1_fp32_grad"] + window
        terms["finish_grads_moment"] = max(0, finish - total)
        total += terms["finish_grads_moment"]
    return {"params": params, "dp": lay.dp, "model_states": states, "activations": a, "terms": terms,
            "total": total}


def _fsdp2_last_block_bytes(cfg: Config, lay: _Layout, shape, states: dict, act: dict, params: int, layers: int,
                            cp: int) -> int:
    """Bytes FSDP2 (one micro-batch per step, no pipeline) holds in the backward of the last block it
    reaches (block 0), on one rank: the step's peak when the activations are small (full
    recomputation at Llama-3-70B's size: 1.216 x the loss's moment before this was counted).
    Derived from torch 2.13's ``fully_shard`` (``_fsdp_collectives``: the all-gather output and the
    reduce-scatter input are kept until the next all-gather / post-backward waits on them) and
    measured with a dry run's MemTracker (``tests/test_dryrun_peak.py``, ``fsdp2-dp4-full-grads``):

    * the model states without gradients (the bf16-mixed 16 bytes per shard element less FSDP2's
      4-byte gradient shard: its fp32 parameter shard and Adam's two moments);
    * the fp32 gradient shards of the blocks already reduced, L - 2 of them (4 B/N bytes each, B a
      block's parameters on this tp rank, N the shard group);
    * block 1's reduce-scatter input in ``reduce_dtype`` (red B), held until the next post-backward;
    * block 0's all-gather output and its unsharded parameters, both in the compute dtype (2 ce B);
    * the root (embedding, final norm, head), gathered at the backward's start and resharded in its
      post-backward at the end (ce R), and the head's unsharded weight gradient (ce V/t h);
    * one layer's saved activations (its checkpointed input under full recomputation), the
      recompute workspace and the block's backward with its unsharded weight gradients
      (:func:`~zerotron.analysis.activations.block_backward_bytes` with ``grad_bytes`` = ce).

    Several micro-batches per step (FSDP2's ``no_sync`` keeps every block's unsharded gradient
    until the last) are not modelled."""
    from zerotron.analysis.activations import block_backward_bytes
    from zerotron.parallel.precision import reduce_dtype

    bf16 = lay.dtype == "bf16"
    e = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    ce, pb = (2, 4) if bf16 else (e, e)  # compute dtype; sharded parameters and gradients
    red = reduce_dtype(lay.dtype, cfg.parallel.reduce_dtype).itemsize
    block = shape.block_params(lay.tp)
    root, head = params - layers * block, -(-shape.vocab_size // lay.tp) * shape.n_embd
    seq, shards = lay.seq // cp, lay.dp * cp // lay.dp_replicate  # a rank's tokens; the shard group (dp x cp)
    no_grads = states["total_bytes"] - (2 if bf16 else 1) * states["grads_bytes"]
    bwd = block_backward_bytes(shape, seq, lay.micro_batch, lay.tp, lay.sp, _ACT_DTYPE[lay.dtype], bf16, bf16,
                               grad_bytes=ce)
    acts = act["per_layer_bytes"] + act["recompute_workspace_bytes"] + bwd
    return (no_grads + pb * max(0, layers - 2) * -(-block // shards) + (red + 2 * ce) * block + ce * (root + head)
            + acts)


def planned_comm(cfg: Config, plan, pp_rank: int, layer_counts: list[int] | None = None) -> dict:
    """Bytes per group of one step the planner prices for pipeline rank ``pp_rank``
    (:func:`zerotron.analysis.planner.comm_bytes`): the training dtype's element size, gradient
    reductions in ``parallel.reduce_dtype``'s (``parallel.precision.reduce_dtype``), ``layer_counts``
    the runner's layers per model stage (a record's ``layer_counts``; None: the even split)."""
    from zerotron.analysis.planner import comm_bytes
    from zerotron.parallel.precision import reduce_dtype

    mcfg = model_config(cfg)
    lay = _layout(cfg, plan, mcfg)
    elem = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
    layout = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero_stage": lay.zero_stage, "micro_batch": lay.micro_batch,
              "schedule": lay.schedule if lay.pp > 1 else "none", "recompute": lay.recompute,
              "dp_replicate": lay.dp_replicate, "cp": plan.dims.cp, "zero_impl": cfg.parallel.zero_impl}
    red = reduce_dtype(cfg.train.dtype, cfg.parallel.reduce_dtype).itemsize
    out = comm_bytes(shape_of(mcfg), layout, lay.seq, cfg.train.global_batch, pp_rank, elem_bytes=elem,
                      sp=lay.sp, bucket_bytes=int(cfg.parallel.bucket_mb * 2**20), reduce_bytes=red,
                      layer_counts=layer_counts)
    if plan.dims.cp > 1 and cfg.parallel.cp_impl != "ring":  # the planner prices ring attention's messages only
        out.pop("cp", None)
    return out


def predict_step_time(cfg: Config, plan, records: list[dict], hw, gpus_per_node: int = 8,
                      compute_eff: float = 0.5, launch_s: float = 20e-6) -> dict:
    """The step time of ``cfg``'s layout on ``hw`` (a :class:`~zerotron.analysis.hardware.Hardware`)
    predicted from the traced ``records`` (:mod:`zerotron.analysis.trace_time`) and by the
    planner's formula (:func:`zerotron.analysis.planner.evaluate`, same hardware, ``compute_eff``,
    ``gpus_per_node``, ``launch_s``; None under context parallelism with cp_impl a2a or
    allgather: the planner prices ring attention only). Adds to each record ``time_traced_s`` (its :func:`~zerotron.analysis.trace_time.rank_time`)
    ``group_scopes`` (:func:`~zerotron.analysis.trace_time.group_scopes` of its ``group_members`` on
    nodes of ``gpus_per_node`` ranks) and ``flops_formula`` (the planner's matmul + attention FLOPs of that rank's m micro-batches,
    :func:`zerotron.analysis.planner.m_flops`, / cp under context parallelism). Returns ``{"hardware", "trace":
    step_time's dict, "formula": {"step_s", "breakdown_s"} or None, "ratio": trace / formula}``."""
    from zerotron.analysis.planner import CostModel, evaluate, m_flops, recompute_flops

    mcfg = model_config(cfg)
    lay = _layout(cfg, plan, mcfg)
    shape = shape_of(mcfg)
    cp = plan.dims.cp
    m = cfg.train.global_batch // (plan.dims.size("dp") * cfg.train.micro_batch)
    split = [r["layer_counts"] for r in records if r["layer_counts"]]
    counts = looped_counts(split[0] if split else stage_layer_counts(shape.n_layer, lay.pp * lay.virtual_stages),
                           lay.pp, lay.schedule)
    layers = [sum(counts[c * lay.pp + r] for c in range(lay.virtual_stages)) for r in range(lay.pp)]
    parts = {}
    for rec in records:
        rec["group_scopes"] = group_scopes(rec["group_members"], rec["comm_traced"], gpus_per_node)
        rec["time_traced_s"] = rank_time(rec["counts_traced"], rec["comm_traced"], rec["group_scopes"], hw,
                                         compute_eff)
        pp_rank = rec["coords"]["pp"]
        parts.setdefault(pp_rank, rec["time_traced_s"])
        rec["flops_formula"] = m * m_flops(shape, lay.micro_batch, lay.seq, layers[pp_rank], pp_rank == lay.pp - 1,
                                           lay.tp, lay.recompute) / cp  # each rank: S/cp queries against S keys
    h, W, S = shape.n_embd, shape.block_matmul_params(), lay.seq
    cost_split = (2 * W + 4 * h * S, 2 * W + 8 * h * S + recompute_flops(shape, S, lay.recompute), 2 * W)
    trace = step_time(parts, layers, m, lay.schedule if lay.pp > 1 else "none", lay.virtual_stages, cost_split,
                      hw, launch_s)
    formula = None
    if cp == 1 or cfg.parallel.cp_impl == "ring":  # the planner prices ring attention only
        elem = {"fp32": 4, "bf16": 2, "fp64": 8}[lay.dtype]
        cm = CostModel(hw, gpus_per_node=gpus_per_node, compute_eff=compute_eff, overhead=0, sp=lay.sp,
                       launch_s=launch_s, elem_bytes=elem, bucket_bytes=int(cfg.parallel.bucket_mb * 2**20))
        layout = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "zero_stage": lay.zero_stage,
                  "schedule": lay.schedule if lay.pp > 1 else "none", "micro_batch": lay.micro_batch,
                  "recompute": lay.recompute, "dp_replicate": lay.dp_replicate, "cp": cp,
                  "zero_impl": cfg.parallel.zero_impl}
        ev = evaluate(shape, layout, S, cfg.train.global_batch, cm)
        formula = {"step_s": ev["predicted_step_time_s"], "breakdown_s": ev["time_breakdown_s"]}
    return {"hardware": hw.name, "gpus_per_node": gpus_per_node, "compute_eff": compute_eff, "trace": trace,
            "formula": formula, "ratio": _ratio(trace["step_s"], formula["step_s"]) if formula else None}


# ---- the entry point -----------------------------------------------------------------------------

def _ratio(a, b):
    return a / b if b else None


def dry_run(cfg: Config, world: int, ranks: list[int] | None = None, gpu_mem: int | None = None,
            hw=None, gpus_per_node: int = 8, compute_eff: float = 0.5, launch_s: float = 20e-6) -> list[dict]:
    """Trace one training step of each of ``ranks`` (default :func:`default_ranks`) of ``cfg``'s
    layout on ``world`` ranks, in this process (module docstring). ``gpu_mem``: capacity in bytes
    for the out-of-memory report. Returns one record per rank: ``rank``, ``coords`` (axes and
    combined groups), ``peak_bytes_traced`` and ``peak_traced`` (bytes per :data:`CATEGORIES` at
    the peak of the measured step), ``peak_at`` (phase, module, pass), ``setup_peak_bytes`` (the
    traced model build and ``parallelize``: dense, as fake tensors cannot be built deferred, see
    ``models.deferred``), ``meta_init`` (``train.meta_init``) and ``construction_bytes`` (what a
    real rank's meta-device construction peaks at: what it holds after ``parallelize`` + the
    largest dense tensor), ``model_state_bytes`` (the strategy's own count after the
    step), ``peak_bytes_estimated`` and ``estimated`` (:func:`estimate`), ``comm_bytes_traced`` /
    ``comm_bytes_planned`` ({group: bytes} of the measured step; the planner's where it prices the
    group), ``comm_traced`` (per group: bytes, calls, bytes per op/tag), ratios traced/estimated,
    ``oom`` (None, or the first moment the total exceeded ``gpu_mem``: phase, module, pass, the
    category that grew, bytes; phase "model states" with the largest category when the states
    held before the step already exceed it; phase "setup" when the model build
    (``construction_bytes`` with ``train.meta_init``, else the dense build's peak) already does, and then
    ``oom_step`` says what the step would do), ``wall_s`` and ``max_rss_bytes`` (of this process so far);
    ``counts_traced`` (FLOPs, element passes, ops of the measured step:
    :class:`~zerotron.analysis.trace_time.StepCounter`), ``flops_traced`` beside ``flops_formula``,
    ``group_members`` (global ranks per traced group), ``group_scopes`` (size, intra-node per
    traced group on nodes of ``gpus_per_node`` ranks),
    ``time_traced_s`` and ``step_time`` (:func:`predict_step_time` on ``hw``, default the
    datasheet H100 preset, at ``compute_eff``, ``launch_s`` seconds per layer and micro-batch; the
    same dict in every record).
    A world-size-1 default process group of the caller (e.g. a test's) is replaced by the fake one
    during the trace and re-created afterwards (same backend); one of more ranks is refused.
    Raises DryRunError for a config the plan refuses on ``world`` ranks, a rank outside it, or a
    caller inside a multi-rank job."""
    from zerotron.plan import build_plan

    try:
        plan = build_plan(cfg, world)
    except ConfigError as e:  # the plan speaks of the training launcher's --nproc; here it is --world
        msg = str(e).replace("--nproc", "--world")
        raise DryRunError(msg if f"world size {world}" in msg else f"{msg} (world size {world})") from None
    if plan.runner not in ("plain", "pipeline"):
        raise DryRunError(f"parallel.pp_impl = {cfg.parallel.pp_impl!r} cannot be dry-run (it runs its stages in "
                          "threads or through torch.distributed.pipelining); use the native pipeline")
    if plan.shape and plan.shape.get("n_experts"):
        raise DryRunError("mixture-of-experts models cannot be dry-run yet (the router's per-expert token counts are "
                          "data-dependent shapes, which fake tensors do not have); dry-run a dense model")
    if cfg.parallel.dp_impl == "torch" and plan.dims.size("dp") > 1:
        raise DryRunError("parallel.dp_impl = 'torch' cannot be dry-run (torch DDP checks the parameters' data "
                          "across ranks at construction; fake tensors have none); use dp_impl = 'native'")
    ranks = default_ranks(plan.dims) if ranks is None else list(ranks)
    for r in ranks:
        if not 0 <= r < world:
            raise DryRunError(f"--rank {r} is not a rank of world size {world}; choose 0..{world - 1}")
    import torch.distributed as dist

    held = dist.get_backend() if dist.is_initialized() else None  # the caller's default group
    if held is not None and dist.get_world_size() > 1:
        raise DryRunError("a dry run replaces this process's default process group with a fake one; run it in a "
                          f"process of its own, not inside a {dist.get_world_size()}-rank job")
    out = []
    try:
        for r in ranks:
            out.append(_trace_rank(cfg, plan, r, gpu_mem))
    finally:
        if held is not None and not dist.is_initialized():  # give a world-1 caller its group back
            from zerotron.distributed.mesh import init_distributed

            init_distributed(held)
    for rec in out:
        pp_rank = rec["coords"]["pp"]
        est = estimate(cfg, plan, pp_rank, rec["layer_counts"], rec["coords"].get("tp", 0))
        planned = planned_comm(cfg, plan, pp_rank, rec["layer_counts"])
        rec.update(peak_bytes_estimated=est["total"], estimated=est, comm_bytes_planned=planned,
                   ratios={"peak": _ratio(rec["peak_bytes_traced"], est["total"]),
                           "model_states": _ratio(rec["model_state_bytes"]["total_bytes"],
                                                  est["model_states"]["total_bytes"]),
                           "comm": {g: _ratio(rec["comm_bytes_traced"].get(g, 0), b) for g, b in planned.items()}},
                   max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   world=world, gpu_mem=gpu_mem)
        rec["oom_step"] = rec["oom"]
        build = rec["construction_bytes"] if rec["meta_init"] else rec["setup_peak_bytes"]
        if gpu_mem is not None and build > gpu_mem:  # the first moment: the model's build
            rec["oom"] = {"phase": "setup", "module": None, "pass": None, "category": "parameters",
                          "total_bytes": build}
    if hw is None:
        from zerotron.analysis.hardware import hardware
        hw = hardware("h100")
    step = predict_step_time(cfg, plan, out, hw, gpus_per_node, compute_eff, launch_s)
    for rec in out:
        rec["step_time"] = step
        rec["ratios"]["flops"] = _ratio(rec["flops_traced"], rec["flops_formula"]) if rec["flops_formula"] else None
    return out
