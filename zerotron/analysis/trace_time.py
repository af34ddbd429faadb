"""Step time predicted from a dry run's trace (issue 33, deliverable 3).

A dry run (:mod:`zerotron.analysis.dryrun`) executes the real code of one training step of a rank
with fake tensors. :class:`StepCounter`, a dispatch mode active during the measured step, reads off
every aten op the rank runs:

* **FLOPs** of matmuls and attention by torch's own formulas (``torch.utils.flop_counter``'s
  registry: mm, addmm, bmm, baddbmm, the SDPA kernels), plus the CPU flash-attention kernels the
  registry lacks (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, priced with the
  same ``sdpa_flop_count`` / ``sdpa_backward_flop_count``); recomputed forwards are counted as run;
* **element passes** of every other op that computes (its output elements; views, ``empty*`` and
  non-aten ops are free): the memory-bound ("vector") work of norms, activations, softmax, the
  loss, copies into flat buffers and the optimizer's update;
* the number of ops.

:func:`rank_time` prices one traced rank on a :class:`~zerotron.analysis.hardware.Hardware` preset:
compute = FLOPs / (peak x ``compute_eff``), vector = passes / ``vector_rate``, and each traced
collective (op, group, calls, bytes from ``comm.STATS``) by the alpha-beta model
(:func:`~zerotron.analysis.hardware.collective_time`) on the link its group crosses: the
intra-node link when all of the group's ranks sit on one node of ``gpus_per_node`` consecutive
ranks, else the inter-node link (the planner's rule, decided here from the group's actual ranks).
Collectives of the tp, cp and pp groups are on the stage's critical path (blocking, per
micro-batch); those of the data-parallel groups (dp, batch, shard, replicate, ...) are the step's
data-parallel part, of which the fraction ``hw.overlap`` hides behind the backward
(:func:`zerotron.analysis.cost_model.exposed_dp`). Point-to-point transfers are priced at the sender
(a receive is the other end of the same transfer).

:func:`step_time` composes the ranks as the planner does (:func:`zerotron.analysis.bubble.pipeline_time`:
the slowest stage runs all m micro-batches, fill and drain pass once through the others at the
schedule's relative idle) plus the exposed data-parallel time and the planner's per-layer launch
overhead (``launch_s`` per layer and micro-batch: the trace has no clock). Pipeline stages that were
not traced take the per-layer time of the traced non-last stage (the first stage: the same blocks
and an embedding lookup, no FLOPs) times their layer count. Only the trace's counts enter; the
formula's own prediction (:func:`zerotron.analysis.layout_cost.evaluate`) is reported beside it.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from zerotron.analysis.bubble import pipeline_time
from zerotron.analysis.cost_model import exposed_dp
from zerotron.analysis.hardware import Hardware, collective_time

__all__ = ["StepCounter", "STAGE_GROUPS", "group_scopes", "rank_time", "step_time"]

STAGE_GROUPS = ("tp", "cp", "pp")
"""Groups whose collectives sit on a stage's critical path; every other group is data-parallel."""

_aten = torch.ops.aten
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
         "lift_fresh", "detach", "alias", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel"}
_OP = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
       "broadcast": "all_gather", "all_to_all": "all_gather", "send": "p2p"}
"""How each ``comm`` op is priced: broadcast and all-to-all move (n-1)/n of the buffer per rank, as
an all-gather does; a send is a p2p transfer; receives are the senders' transfers."""


def _cpu_flash_forward(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_CPU_FLASH = {}
for _name, _fn in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_flash_forward),
                   ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_flash_backward)):
    if hasattr(_aten, _name):
        _CPU_FLASH[getattr(_aten, _name).default] = _fn


class StepCounter(TorchDispatchMode):
    """Dispatch mode counting, while active, ``flops`` (matmul and attention FLOPs by torch's
    formulas, module docstring), ``element_passes`` (output elements of every other computing aten
    op) and ``ops`` (aten ops that compute). Works under ``FakeTensorMode`` (shapes only).
    ``flops_by_op``: FLOPs per op name."""

    def __init__(self):
        super().__init__()
        self.flops = 0
        self.element_passes = 0
        self.ops = 0
        self.flops_by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace != "aten" or func.is_view or packet.__name__ in _FREE:
            return out
        self.ops += 1
        if func in _CPU_FLASH:
            f = _CPU_FLASH[func](*args, **kwargs)
        elif packet in flop_registry:
            f = flop_registry[packet](*args, **kwargs, out_val=out)
        else:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.element_passes += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
            return out
        self.flops += int(f)
        self.flops_by_op[packet.__name__] = self.flops_by_op.get(packet.__name__, 0) + int(f)
        return out


def group_scopes(members: dict, labels, gpus_per_node: int) -> dict:
    """``{label: {"size": n, "intra": bool}}`` for the accounting labels ``labels`` from ``members``
    (``comm.STATS.members``: label -> global ranks): the group's size, and whether all its ranks
    lie on one node of ``gpus_per_node`` consecutive global ranks."""
    out = {}
    for label in labels:
        rs = members[label]
        out[label] = {"size": len(rs), "intra": len({r // gpus_per_node for r in rs}) == 1}
    return out


def rank_time(counts: dict, comm_traced: dict, scopes: dict, hw: Hardware, compute_eff: float) -> dict:
    """Seconds of one traced rank's step parts on ``hw``: ``compute`` (``counts["flops"]`` at
    peak x ``compute_eff``), ``vector`` (``counts["element_passes"]`` at ``hw.vector_rate``),
    ``stage_comm`` and ``dp_comm`` ({group: seconds}, module docstring) from ``comm_traced``
    (the dry run's per-group ``ops``: {"op/tag": {"calls", "bytes"}}) and ``scopes``
    (:func:`group_scopes`). Latencies include ``hw.sync_penalty`` per call."""
    stage, dp = {}, {}
    for group, rec in comm_traced.items():
        sc = scopes[group]
        bw, lat = (hw.intra, hw.latency_intra) if sc["intra"] else (hw.inter, hw.latency_inter)
        lat = {op: v + hw.sync_penalty for op, v in lat.items()}
        t = 0.0
        for key, c in rec["ops"].items():
            op = _OP.get(key.split("/", 1)[0])
            if op is not None:
                n = 2 if op == "p2p" else sc["size"]
                t += collective_time(c["bytes"], op, n, bw, lat, calls=c["calls"])
        (stage if group in STAGE_GROUPS else dp)[group] = t
    return {"compute": counts["flops"] / (hw.peak_flops * compute_eff),
            "vector": counts["element_passes"] / hw.vector_rate, "stage_comm": stage, "dp_comm": dp}


def step_time(parts: dict, layers: list[int], m: int, kind: str, v: int, split: tuple, hw: Hardware,
              launch_s: float) -> dict:
    """Predicted seconds of one step from traced ranks. ``parts``: {pipeline rank: :func:`rank_time`
    of a traced rank of that stage}; ``layers``: transformer blocks per pipeline rank (all chunks);
    ``m`` micro-batches; ``kind``/``v``/``split``: the schedule, its chunks per rank and the F : B : W
    cost split of a layer (:func:`zerotron.analysis.bubble.pipeline_time`). Returns
    ``{"step_s", "stage_s" (per micro-batch, every pipeline rank), "breakdown_s": {compute, vector,
    overhead, stage_comm of the slowest stage x m; bubble; dp_comm exposed}, "estimated_stages":
    the pipeline ranks not traced}``. Raises ValueError when no stage was traced."""
    pp = len(layers)
    if not parts:
        raise ValueError("no traced rank to predict a step time from")

    def busy(p):
        return {"compute": p["compute"], "vector": p["vector"], "stage_comm": sum(p["stage_comm"].values())}
    per_mb = {r: {k: t / m for k, t in busy(p).items()} for r, p in parts.items()}
    ref = min((r for r in per_mb if r != pp - 1), default=min(per_mb))  # a traced stage without the head
    stages, est = [], []
    for r in range(pp):
        if r in per_mb:
            t = dict(per_mb[r])
        else:
            est.append(r)
            t = {k: x * layers[r] / max(1, layers[ref]) for k, x in per_mb[ref].items()}
        t["overhead"] = layers[r] * launch_s
        stages.append(t)
    times = [sum(t.values()) for t in stages]
    slow = max(range(pp), key=lambda r: times[r])
    pipe = pipeline_time(times, m, kind, v, split)
    t_dp = max(sum(p["dp_comm"].values()) for p in parts.values())
    dp = exposed_dp(t_dp, m * (stages[slow]["compute"] + stages[slow]["vector"]), hw.overlap)
    breakdown = {k: m * x for k, x in stages[slow].items()}
    breakdown.update(bubble=pipe - m * times[slow], dp_comm=dp)
    return {"step_s": pipe + dp, "stage_s": times, "breakdown_s": breakdown, "estimated_stages": est}
