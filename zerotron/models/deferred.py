"""Deferred (meta-device) initialisation with the dense model's values: build a model on the meta
device, let the parallel transforms cut it (tensor-parallel slices, pipeline stages), then give
storage and values only to the parameters this rank keeps (issue 33: a 70B model cannot be built
densely on every rank of an 80 GB cluster).

Initial weights must not depend on the layout (DESIGN: "init the full model from the seed, then
shard"): every layout equals one process. So the values of a local slice are cut from the *dense*
tensor drawn in the dense init's RNG order. The route chosen here is exact and simple:

1. :func:`build_deferred` builds the model under ``torch.device("meta")`` while a dispatch mode
   records every in-place op the constructors and ``reset_parameters`` run on meta tensors (the
   init: ``uniform_`` of nn.Linear's default init, the family's ``normal_``, ``fill_`` of norms...),
   in order. Then, for each recorded op that draws random numbers (``nondeterministic_seeded``), it
   saves torch's CPU generator state and runs the op once on a scratch tensor of the target's
   shape and dtype, freed at once: the generator advances exactly as in a dense build (the draw
   count of a CPU kernel depends only on the shape and dtype of a contiguous tensor), so whatever
   draws from the global RNG afterwards sees the same state as after a dense build.
2. ``zerotron.parallel.parallelize`` runs the model-parallel transforms on the meta model (a
   tensor-parallel layer's new parameter is :func:`adopt`-ed by the dense one it is cut from), then
   gives storage and values only to what this rank keeps (:func:`materialise_params`), as late as
   possible: a pipeline rank leaves the other stages' parameters on the meta device (:func:`release_params`;
   a dense model's are swapped to meta tensors the same way, :func:`restore_params` gives them memory
   back while the pipeline's ``full_params`` is open); ZeRO
   materialises each parameter just before copying it into its flat buffer, FSDP2 each block just
   before ``fully_shard`` frees it; DDP and the other runners take the (model-parallel part of the)
   model whole. A parameter's values: the full dense tensor re-created from the saved generator
   states (the ops since its last full overwrite: e.g. ``normal_`` after nn.Linear's
   ``uniform_``), cut with ``DeferredInit.slice_fn`` (tensor parallel: ``tensor.layers.local_shard``),
   copied in; the full tensor is dropped before the next one. :func:`finish` materialises what is
   left and rebuilds the buffers (``init_buffers``: RoPE tables).

Peak memory of the construction: what this rank keeps, plus one full tensor (the largest, e.g.
the (V, C) embedding) -- for ZeRO one unit's flat buffer, for FSDP2 one dense block -- instead of
the whole dense model; time: the dense init's draws once (to advance the generator) plus the
kept tensors' draws again.

Limits: not under a FakeTensorMode (the dry run builds densely and reports the construction
memory of this path from what the rank holds, ``analysis.dryrun``): a fake meta parameter can be
neither given CPU data in place (``set_data`` refuses the device change) nor swapped (the fake
mode and the memory tracker hold weak references to it). An init op on a view of a parameter (e.g. ``nn.Embedding``'s ``padding_idx`` row) or a
parameter without any recorded op raises ValueError in :func:`materialise_params` (no zerotron model
has either); LoRA adapters and ``model.init_from`` weights are added to a dense model only
(``train.meta_init`` is then not used).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DeferredInit", "build_deferred", "is_deferred", "adopt", "materialise_params", "release_params",
           "restore_params", "finish",
           "target_device"]

_FULL_OVERWRITE = {"normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_",
                   "geometric_", "log_normal_", "cauchy_"}


@dataclass
class _Op:
    target: torch.Tensor  # the meta tensor (kept referenced: ids stay unique)
    func: object  # an aten OpOverload, in place on ``target``
    args: tuple
    kwargs: dict
    shape: tuple = ()  # the target's shape and dtype when the op ran (a later Module.to may change them)
    dtype: torch.dtype = torch.float32
    rng_state: torch.Tensor | None = None  # CPU generator state before a random op


@dataclass
class DeferredInit:
    """The recorded init of a meta-device model: ``ops`` in the dense build's order; ``device``
    where :func:`materialise_params` puts the parameters; ``slice_fn(param, full) -> local`` (set by
    a transform that cuts parameters: tensor parallelism), None = the full tensor."""

    ops: list = field(default_factory=list)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    slice_fn: object = None
    _buffers: dict = field(default_factory=dict)

    def scratch(self, shape, dtype) -> torch.Tensor:
        """A contiguous CPU tensor of ``shape`` and ``dtype``: a view of one reused buffer per dtype
        (grown to the largest tensor), so that drawing tensor after tensor does not fragment the
        heap (fresh tensors between the small kept RNG states grew the process by the whole model)."""
        n = math.prod(shape)
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < n:
            self._buffers[dtype] = buf = None
            self._buffers[dtype] = buf = torch.empty(n, dtype=dtype, device="cpu")
        return buf[:n].view(shape)

    def chain(self, t: torch.Tensor) -> list:
        """The ops that set ``t``'s final values: from its last full overwrite on. Raises ValueError
        if there is none."""
        mine = [op for op in self.ops if op.target is t]
        last = max((i for i, op in enumerate(mine) if op.func.__name__.split(".")[0] in _FULL_OVERWRITE),
                   default=None)
        if last is None:
            raise ValueError(f"deferred init: a parameter of shape {tuple(t.shape)} has no recorded full "
                             "initialisation (an init on a view, or none); build this model densely")
        return mine[last:]


class _Recorder(TorchDispatchMode):
    """Records in-place ops on meta tensors (the constructors' and reset_parameters' init)."""

    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema.arguments
        if (args and isinstance(args[0], torch.Tensor) and args[0].is_meta and schema
                and schema[0].alias_info is not None and schema[0].alias_info.is_write):
            if args[0]._base is not None:  # a view: the chain of its base cannot be replayed whole
                base = args[0]._base
                self.ops.append(_Op(base, _VIEW_INIT, (), {}, tuple(base.shape), base.dtype))
            else:
                self.ops.append(_Op(args[0], func, tuple(args[1:]), dict(kwargs), tuple(args[0].shape), args[0].dtype))
        return out


def _view_init(*_a, **_k):  # marker: an init op ran on a view of this tensor
    raise ValueError("deferred init: an init op ran on a view of a parameter; build this model densely")


_view_init.__name__ = "view_init"
_VIEW_INIT = _view_init


def _random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def build_deferred(build, device: torch.device | str = "cpu") -> torch.nn.Module:
    """``build()`` (a zero-argument model constructor, e.g. ``lambda: registry.build_model(cfg)``)
    run on the meta device with its init ops recorded (module docstring), then torch's CPU
    generator advanced as the dense build would have advanced it. Returns the meta-device model
    with ``model.deferred_init`` (a :class:`DeferredInit`; ``device``: where :func:`materialise_params`
    puts the parameters; also on every parameter as ``_deferred``). Costs no parameter memory: one full tensor at a time, for the draws."""
    rec = _Recorder()
    with torch.device("meta"), rec:
        model = build()
    init = DeferredInit(rec.ops, torch.device(device))
    for op in rec.ops:
        if op.func is not _VIEW_INIT and _random(op.func):
            op.rng_state = torch.get_rng_state()
            op.func(init.scratch(op.shape, op.dtype), *op.args, **op.kwargs)
    model.deferred_init = init
    for q in model.parameters():
        q._deferred = init
    return model


def is_deferred(model) -> bool:
    """Whether ``model`` still awaits :func:`finish` (built by :func:`build_deferred`)."""
    return getattr(model, "deferred_init", None) is not None


def _full_values(init: DeferredInit, t: torch.Tensor) -> torch.Tensor:
    """The dense values of the recorded meta tensor ``t`` (CPU, in its dtype at init time), in the
    init's scratch buffer (valid until the next call)."""
    chain = init.chain(t)
    full = init.scratch(chain[0].shape, chain[0].dtype)
    for op in chain:
        if op.rng_state is not None:
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(op.rng_state)
                op.func(full, *op.args, **op.kwargs)
        else:
            op.func(full, *op.args, **op.kwargs)
    return full


def adopt(param: torch.Tensor, source: torch.Tensor) -> None:
    """Mark the meta ``param`` made by a transform (e.g. a tensor-parallel layer's) as cut from the
    recorded dense meta parameter ``source``: :func:`materialise_params` gives it its slice of
    ``source``'s dense values (``DeferredInit.slice_fn``)."""
    param._deferred, param._deferred_source = source._deferred, getattr(source, "_deferred_source", source)


def materialise_params(params) -> int:
    """Give each still-meta parameter of ``params`` (of a deferred model, possibly transformed) its
    storage on the init's device and its values: the full dense tensor re-created from the saved
    generator states (module docstring), cut by ``DeferredInit.slice_fn(param, full)`` when set,
    copied in; the full tensor is dropped before the next parameter (peak: one full tensor).
    Parameters keep their identity (:func:`_swap_in`), so ties and references stay valid;
    others are skipped. Returns the bytes given. Raises ValueError for a parameter without a
    recorded full initialisation."""
    total = 0
    with torch.no_grad():
        for p in params:
            init = getattr(p, "_deferred", None)
            if init is None:
                continue
            full = _full_values(init, getattr(p, "_deferred_source", p))
            local = init.slice_fn(p, full) if init.slice_fn is not None else full
            p._deferred = None
            _swap_in(p, torch.empty(p.shape, dtype=p.dtype, device=init.device))
            p.copy_(local)
            total += p.numel() * p.element_size()
            del full, local
    return total


def _swap_in(p: torch.Tensor, data: torch.Tensor) -> None:
    """Make the meta parameter ``p`` hold ``data`` (another device) in place: ``p.data = ...``
    refuses a meta -> CPU change, so the tensors are swapped (``torch.utils.swap_tensors``), keeping
    the Python object (its identity: ties, masks, lists) and its attributes (e.g. ``tp_shard``)."""
    new = torch.nn.Parameter(data, requires_grad=p.requires_grad) if isinstance(p, torch.nn.Parameter) else data
    new.__dict__.update(p.__dict__)
    torch.utils.swap_tensors(p, new)


def target_device(p: torch.Tensor) -> torch.device:
    """Where ``p`` lives, or will once materialised (a deferred meta parameter: the init's device;
    one :func:`release_params` left without memory, another pipeline stage's: where it lived)."""
    init = getattr(p, "_deferred", None)
    if init is not None:
        return init.device
    return getattr(p, "_released_to", None) or p.device if p.is_meta else p.device


def release_params(params) -> int:
    """Leave every parameter of ``params`` without memory (a pipeline rank: the other stages'),
    shape and dtype kept: a meta tensor is swapped in (:func:`_swap_in`: identity, ties and
    attributes kept), so nothing can read or write memory the parameter does not have -- torch
    refuses a meta tensor beside a CPU/CUDA one, gloo refuses the meta device, a copy out of it
    raises. (A CPU tensor keeping its shape over a 0-byte storage, the earlier way, has a null data
    pointer that any op would dereference at its offset; nothing stopped an op reaching it.) A
    deferred (meta) parameter only forgets its recorded init. Under a FakeTensorMode (the dry run,
    which holds no memory and cannot swap fake parameters) the fake storage is resized to 0.
    :func:`restore_params` gives the memory back. Returns the bytes released (numel x element size)."""
    freed = 0
    for p in params:
        freed += p.numel() * p.element_size()
        if getattr(p, "fake_mode", None) is not None:
            if not p.data.untyped_storage().resizable():
                p.data = torch.empty_like(p.data)
            p.data.untyped_storage().resize_(0)
            continue
        init = getattr(p, "_deferred", None)
        if init is not None:  # still meta: where it would have lived
            p._deferred, p._released_to = None, init.device
        elif not p.is_meta:
            p._released_to = p.device
            _swap_in(p, torch.empty(p.shape, dtype=p.dtype, device="meta"))
    return freed


def restore_params(params) -> None:
    """Give every parameter :func:`release_params` left without memory fresh, uninitialised memory
    on its device (the caller fills it: e.g. the pipeline's ``full_params`` broadcasts each stage's
    weights in), identity, shape and dtype kept; others are skipped."""
    for p in params:
        if getattr(p, "fake_mode", None) is not None:
            p.data.untyped_storage().resize_(p.numel() * p.element_size())
        elif p.is_meta and getattr(p, "_released_to", None) is not None:
            _swap_in(p, torch.empty(p.shape, dtype=p.dtype, device=p._released_to))


def finish(model: torch.nn.Module) -> int:
    """End the deferred init of ``model``: every parameter still on the meta device materialised
    (:func:`materialise_params`), every meta buffer re-created empty and filled by
    ``model.init_buffers()`` (RoPE tables; every zerotron model has it), ``model.deferred_init``
    cleared (a second call does nothing). Returns the bytes given to parameters here."""
    init: DeferredInit = getattr(model, "deferred_init", None)
    if init is None:
        return 0
    total = materialise_params(list({id(q): q for q in model.parameters()}.values()))
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=init.device)
    model.deferred_init = None
    init._buffers.clear()
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    return total
