"""The parity matrix: every layout the config space allows, generated, and trained against one process.

A *layout* is one value per factor of :data:`FACTORS` -- gradient sync (native DDP, torch DDP,
native ZeRO-1/2/3, FSDP2 stage 2/3), dp degree, tp degree, sequence parallelism, pp degree,
pipeline schedule (or "threads": the pp stages as worker threads of each process, GPipe,
``parallel.pp_impl = threads``), gradient accumulation (micro-batches per dp rank per step), the pipeline
split (``parallel.pp_split`` auto | even: on the matrix model "auto" gives 5,3 at pp 2 and 3,2,2,1
at pp 4, so it runs uneven stages) and HSDP replicas (``parallel.dp_replicate``). Options that cannot
matter are canonicalised away (sequence parallelism only with tp > 1, a schedule and a split only with
pp > 1), and at most :data:`MAX_WORLD` processes are used. :func:`all_layouts` enumerates the
full product; :func:`covering_layouts` picks a small set in which every pair of factor values
that occurs in some valid layout occurs at least once (a greedy pairwise covering array).

Each layout trains :data:`STEPS` optimizer steps of the same global batch (:data:`GLOBAL_BATCH`
sequences) in float64 (``train.dtype = "fp64"``) through the real :class:`~zerotron.train.trainer.Trainer`,
with active gradient clipping and evaluation, and is compared with the single-process run of the
same configuration (:func:`reference`):

* losses, gradient norms and validation losses: relative error per step;
* final parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) of the canonical,
  layout-independent state dict: norm-wise relative error per tensor,
  ``||a - b|| / ||b||``;
* every copy of one tensor (dp replicas, tp-replicated parameters on the tp ranks, the tied
  embedding on the first and last pipeline stage) bitwise equal on every rank;
* the dense model ``strategy.full_params()`` yields (evaluation, generation, export): the same
  bits on every rank, the training dtype, and the reference values (plain tensor parallelism
  yields its TP model, which decodes on its shards, and is checked through the canonical state).

In float64 the reassociation noise of a correct layout is ~1e-16 per operation, so the bound
:data:`FP64_RTOL` = 1e-10 holds on any CPU, while a wrong gradient (a missing sum, a race)
moves these numbers by >= 1e-7. Config validation decides which layouts run; every refused one
must be refused for a reason listed by :func:`expected_refusal` (and the test asserts both
directions), never trained silently wrong.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass

from .config import ConfigError
from .plan import build_plan

FACTORS = {
    "sync": ("ddp", "torch_ddp", "zero1", "zero2", "zero3", "fsdp2_2", "fsdp2_3"),
    "dp": (1, 2, 4),
    "tp": (1, 2),
    "sp": (False, True),
    "pp": (1, 2, 4),
    "schedule": ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "threads",
                 "torch-gpipe", "torch-1f1b", "torch-interleaved", "torch-zb"),
    "acc": (1, 4),
    "split": ("auto", "even"),
    "rep": (1, 2),  # parallel.dp_replicate (HSDP: dp = rep replicas x dp/rep shards)
}
# the torch.distributed.pipelining backend (parallel.pp_impl = torch): matrix schedule -> pp_schedule
TORCH_KINDS = {"torch-gpipe": "gpipe", "torch-1f1b": "1f1b", "torch-interleaved": "interleaved", "torch-zb": "zb-h1"}
MAX_WORLD = 8
STEPS = 2
GLOBAL_BATCH = 16
FP64_RTOL = 1e-10
# the matrix model: 8 layers (pp 4 x 2 virtual stages), 4 heads (tp 2), 16 positions (SP over tp 2)
MODEL = {"model.n_layer": 8, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 16,
         "model.dropout": 0.0}
# model families of the matrix (overrides on top of MODEL): GPT-2, and Llama with grouped-query
# attention (4 query heads on 2 kv heads, so tp 2 splits both), SwiGLU, RoPE, untied head
MODELS = {"gpt2": {},
          "llama": {"model.arch": "llama", "model.n_kv_head": 2, "model.intermediate_size": 64,
                    "model.rope_theta": 10000.0}}
TRAIN = {"train.dtype": "fp64", "train.steps": STEPS, "train.global_batch": GLOBAL_BATCH, "train.grad_clip": 0.5,
         "train.warmup_steps": 1, "train.eval_every": STEPS, "train.eval_batches": 1,
         "checkpoint.save_final": "false", "parallel.timeout_s": 120,
         "log.tensorboard": "false"}


@dataclass(frozen=True, order=True)
class Layout:
    """One point of the matrix. ``schedule`` and ``split`` are None when pp == 1; ``sp`` is False
    when tp == 1."""

    sync: str
    dp: int
    tp: int
    sp: bool
    pp: int
    schedule: str | None
    acc: int
    split: str | None = None
    rep: int = 1

    @property
    def world(self) -> int:
        """Processes: dp x tp x pp, except for "threads" (the pp stages are threads of one process)."""
        return self.dp * self.tp * (1 if self.schedule == "threads" else self.pp)

    @property
    def name(self) -> str:
        parts = [self.sync, f"dp{self.dp}" + (f"r{self.rep}" if self.rep > 1 else "")]
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("sp" if self.sp else ""))
        if self.pp > 1:
            parts.append(f"pp{self.pp}-{self.schedule}" + ("-even" if self.split == "even" else ""))
        parts.append(f"acc{self.acc}")
        return "-".join(parts)

    def overrides(self) -> dict:
        """``{"section.field": value}`` config overrides of this layout (on top of MODEL/TRAIN)."""
        o = {"parallel.dp": self.dp, "parallel.tp": self.tp, "parallel.pp": self.pp,
             "parallel.sequence_parallel": str(self.sp).lower(), "parallel.dp_replicate": self.rep,
             "train.micro_batch": max(GLOBAL_BATCH // (self.dp * self.acc), 1)}
        if self.sync == "torch_ddp":
            o["parallel.dp_impl"] = "torch"
        elif self.sync.startswith("zero"):
            o["parallel.zero_stage"] = int(self.sync[-1])
        elif self.sync.startswith("fsdp2"):
            o.update({"parallel.zero_stage": int(self.sync[-1]), "parallel.zero_impl": "fsdp2"})
        if self.schedule == "threads":  # GPipe over pp worker threads of each process
            o.update({"parallel.pp": 1, "parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe",
                      "parallel.virtual_stages": self.pp, "parallel.pp_split": self.split or "auto"})
        elif self.schedule in TORCH_KINDS:  # torch.distributed.pipelining on the same split
            o.update({"parallel.pp_impl": "torch", "parallel.pp_schedule": TORCH_KINDS[self.schedule],
                      "parallel.pp_split": self.split or "auto"})
            if self.schedule == "torch-interleaved":
                o["parallel.virtual_stages"] = 2
        elif self.pp > 1:
            o["parallel.pp_schedule"] = self.schedule
            o["parallel.pp_split"] = self.split or "auto"
            if self.schedule == "interleaved":
                o["parallel.virtual_stages"] = 2
        return o

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "name": self.name, "world": self.world}


def all_layouts(max_world: int = MAX_WORLD) -> list[Layout]:
    """Every canonical layout of the FACTORS product on at most ``max_world`` processes, sorted."""
    out = set()
    f = FACTORS
    for sync, dp, tp, sp, pp, sched, acc, split, rep in itertools.product(*f.values()):
        lay = Layout(sync, dp, tp, sp and tp > 1, pp, sched if pp > 1 else None, acc, split if pp > 1 else None, rep)
        if lay.world <= max_world:
            out.add(lay)
    return sorted(out, key=lambda l: (l.world, l.name))


def config_for(layout: Layout, extra: dict | None = None):
    """The full Config of ``layout`` (tiny.toml + MODEL + TRAIN + the layout's overrides + extra)."""
    from .testing import tiny_config

    return tiny_config({**MODEL, **TRAIN, **layout.overrides(), **(extra or {})})


def refusal(layout: Layout) -> str | None:
    """The plan's verdict (``plan.build_plan``): None if the layout runs, else its one-line message."""
    try:
        build_plan(config_for(layout), layout.world)
    except ConfigError as e:
        return str(e)
    return None


def expected_refusal(layout: Layout) -> str | None:
    """The documented reason a layout cannot run (None: it must run). Config validation must agree
    (tests assert both directions), so an accidental refusal or a silently accepted unsupported
    combination fails the matrix."""
    if layout.rep > 1 and layout.dp % layout.rep:
        return "HSDP: parallel.dp_replicate must divide dp"
    if layout.rep > 1 and layout.sync == "torch_ddp":
        return "HSDP: torch DDP reduces over one flat group"
    if layout.rep > 1 and layout.pp > 1:
        return "HSDP is not combined with pipeline parallelism"
    if layout.pp > 1 and layout.sync in ("fsdp2_2", "fsdp2_3", "torch_ddp"):
        return "pipeline x FSDP2 / torch DDP: their hooks expect one whole-model forward per backward"
    if layout.sync.startswith("fsdp2") and layout.tp > 1:
        return "FSDP2 is not combined with tensor parallelism"
    if layout.schedule in TORCH_KINDS and (layout.sync != "ddp" or layout.tp > 1):
        return "the torch.distributed.pipelining backend combines only with native DDP, tp = 1"
    if layout.schedule == "torch-1f1b" and layout.acc < layout.pp:
        return "torch's Schedule1F1B needs micro-batches per flush >= pp"
    if layout.schedule in ("interleaved", "torch-interleaved") and layout.acc % layout.pp:
        return "interleaved needs micro-batches per flush divisible by pp"
    if layout.schedule == "threads" and (layout.sync != "ddp" or layout.tp > 1):
        return "the threaded executor (pp stages as threads of one process) combines only with native DDP, tp = 1"
    return None


# always in the covering set: pp x dp x tp + SP with native DDP (witness of a fixed defect: the
# tp-replicated gradient sum once ran on bucket memory an all-reduce was still writing),
# pipeline x ZeRO-3 with interleaving (per-action reduce-scatter, blocks gathered per chunk),
# the split backward of zb-h1 under ZeRO-2/3 over a real dp group (reduce-scatter after each W,
# ZeRO-3 blocks gathered for W) and under DDP buckets with tensor parallelism (buckets fire in W),
# and HSDP (dp 4 = 2 replicas x 2 shards) for ZeRO-2, ZeRO-3 and hierarchical DDP, with accumulation
# (shard gradients summed locally, one all-reduce across replicas per step) and with tp 2
MUST = ("ddp-dp2-tp2sp-pp2-1f1b-acc4", "zero3-dp2-pp2-interleaved-acc4", "zero2-dp2-pp2-zb-h1-acc4",
        "zero3-dp2-pp2-zb-h1-acc4", "ddp-dp2-tp2-pp2-zb-h1-acc4", "zero2-dp4r2-acc4", "zero3-dp4r2-acc1",
        "ddp-dp4r2-acc4", "zero3-dp4r2-tp2-acc4", "fsdp2_3-dp4r2-acc1",
        # one per torch.distributed.pipelining schedule, over a real dp group where it fits in 4 ranks
        "ddp-dp2-pp2-torch-gpipe-acc4", "ddp-dp2-pp2-torch-1f1b-acc4", "ddp-dp2-pp2-torch-interleaved-acc4",
        "ddp-dp2-pp2-torch-zb-acc4")


def covering_layouts(layouts: list[Layout]) -> list[Layout]:
    """A greedy pairwise covering array: a subset of ``layouts`` in which every pair of (factor,
    value) assignments that occurs in ``layouts`` occurs at least once, plus the :data:`MUST`
    witnesses. Ties go to fewer processes, then to the name, so the choice is deterministic."""
    keys = list(FACTORS)

    def pairs(l: Layout):
        v = [(k, getattr(l, k)) for k in keys]
        return {(a, b) for a, b in itertools.combinations(v, 2)}

    todo = set().union(*(pairs(l) for l in layouts)) if layouts else set()
    chosen = [l for l in layouts if l.name in MUST]
    rest = sorted((l for l in layouts if l.name not in MUST), key=lambda l: (l.world, l.name))
    for l in chosen:
        todo -= pairs(l)
    while todo:
        best = max(rest, key=lambda l: (len(pairs(l) & todo), -l.world))
        chosen.append(best)
        todo -= pairs(best)
        rest.remove(best)
    return sorted(chosen, key=lambda l: (l.world, l.name))


# ---- running ---------------------------------------------------------------------------------
def _digest(t) -> str:
    t = t.to_local() if hasattr(t, "to_local") else t
    t = t.detach()
    if t.untyped_storage().size() == 0:  # ZeRO-3: freed between uses
        return ""
    return hashlib.sha256(t.cpu().contiguous().numpy().tobytes()).hexdigest()


def _copies(strategy, mesh) -> dict:
    """``{copy key: digest}`` of this rank's parameter tensors; the key names the logical tensor
    slice, so every rank holding the same key must hold the same bits: tp-sharded tensors are keyed
    by tp coordinate, dp-sharded ones (ZeRO-3 / FSDP2 local shards) by dp coordinate."""
    from zerotron.parallel.tensor.layers import is_tp_sharded

    c = mesh.coords
    dp_sharded = getattr(strategy, "stage", 0) == 3 or type(strategy).__name__ == "FSDP2Strategy"
    shard = c["dp"] % mesh.dims.dp_shard  # HSDP: replicas of one shard must hold the same bits
    out = {}
    for name, p in strategy.module.named_parameters(remove_duplicate=False):
        d = _digest(p)
        if not d:
            continue
        key = (name, c["tp"] if is_tp_sharded(p) else None, shard if dp_sharded else None)
        out[key] = d
    return out


def _rel(a, b) -> float:
    import torch

    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float(torch.linalg.vector_norm(a - b) / max(float(torch.linalg.vector_norm(b)), 1e-300))


def _state_errors(msd, osd, ref) -> dict:
    """Max norm-wise errors of this rank's canonical (possibly partial) state against ``ref``."""
    import torch

    perr = max((_rel(v, ref["params"][k]) for k, v in msd.items()), default=0.0)
    oerr, step_ok = 0.0, True
    for fqn, st in osd["state"].items():
        rs = ref["optim"][fqn]
        for k in ("exp_avg", "exp_avg_sq"):
            oerr = max(oerr, _rel(st[k], rs[k]))
        step_ok &= float(torch.as_tensor(st["step"])) == float(torch.as_tensor(rs["step"]))
    return {"param_err": perr, "optim_err": oerr, "step_ok": step_ok,
            "param_keys": sorted(msd), "optim_keys": sorted(osd["state"]),
            "unknown_keys": sorted((set(msd) - set(ref["params"])) | (set(osd["state"]) - set(ref["optim"])))}


def train_layout(layout: Layout, run_dir: str, extra: dict | None = None) -> dict:
    """Train ``layout`` in this process group (every rank calls it). Returns per-step ``losses``,
    ``norms``, ``val`` ({step: val_loss}), the canonical ``msd``/``osd`` (this rank's part), the
    rank's ``coords`` and ``copies`` (see :func:`_copies`). Collective."""
    from .train.trainer import Trainer

    tr = Trainer(config_for(layout, extra), run_dir)
    out = {"losses": [], "norms": [], "val": {}}

    def cb(t, rec):
        out["losses"].append(rec["loss"])
        out["norms"].append(rec["grad_norm"])
        if "val_loss" in rec:
            out["val"][rec["step"]] = rec["val_loss"]

    tr.fit(callback=cb)
    out["msd"], out["osd"] = tr.strategy.state_dict(tr.optimizer)
    out["coords"] = dict(tr.mesh.coords)
    out["copies"] = _copies(tr.strategy, tr.mesh)
    with tr.strategy.full_params() as dense:  # what evaluation, generation and export see
        # plain tensor parallelism yields the TP model itself (it decodes on its shards): not dense
        out["full"] = None if getattr(dense, "tp_group", None) is not None else {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in dense.state_dict().items()}  # FSDP2: DTensors, gathered (collective)
    out["copies"].update({("full_params", k, None, None): _digest(v) for k, v in (out["full"] or {}).items()})
    return out


def reference(run_dir: str, extra: dict | None = None) -> dict:
    """The single-process run of the matrix configuration (world size 1, one micro-batch per step):
    losses, norms, val, and the canonical state as ``{"params": {fqn: tensor}, "optim": {fqn:
    {exp_avg, exp_avg_sq, step}}}`` (CPU tensors). Needs a world-size-1 process group."""
    out = train_layout(Layout("ddp", 1, 1, False, 1, None, 1), run_dir, extra)
    clone = lambda v: v.detach().cpu().clone() if hasattr(v, "detach") else v  # noqa: E731
    return {"losses": out["losses"], "norms": out["norms"], "val": out["val"],
            "params": {k: clone(v) for k, v in out["msd"].items()},
            "optim": {k: {n: clone(x) for n, x in st.items()} for k, st in out["osd"]["state"].items()}}


def _rel_list(a, b) -> float:
    return max((abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a, b)), default=0.0) if len(a) == len(b) \
        else float("inf")


def compare(out: dict, ref: dict) -> dict:
    """Errors of one rank's :func:`train_layout` result against :func:`reference`."""
    vsteps = sorted(ref["val"])
    e = {"loss_err": _rel_list(out["losses"], ref["losses"]),
         "norm_err": _rel_list(out["norms"], ref["norms"]),
         "val_err": _rel_list([out["val"].get(s, float("nan")) for s in vsteps], [ref["val"][s] for s in vsteps]),
         "coords": out["coords"], "copies": out["copies"]}
    e.update(_state_errors(out["msd"], out["osd"], ref))
    full = out["full"] if out["full"] is not None else {k: v for k, v in ref["params"].items()}
    e["missing_full"] = sorted(set(ref["params"]) - set(full))
    e["full_err"] = max((_rel(full[k], v) for k, v in ref["params"].items() if k in full), default=0.0)
    e["full_dtype_ok"] = all(v.dtype == ref["params"][k].dtype for k, v in full.items() if k in ref["params"])
    return e


def run_many(layouts: list[dict], ref_path: str, tmp: str, extra: dict | None = None) -> list[dict]:
    """Worker body (every rank of one spawn): train each layout (given as ``Layout.as_dict()``),
    compare it with the reference saved at ``ref_path`` (``torch.save`` of :func:`reference`),
    and return the per-rank error records (small: no tensors), one per layout. A layout that
    raises is reported with its error message instead of stopping the others (all ranks raise
    together on a config error; other exceptions end the spawn)."""
    import torch

    ref = torch.load(ref_path, weights_only=False)
    res = []
    for d in layouts:
        lay = Layout(**{k: d[k] for k in FACTORS})
        run_dir = f"{tmp}/{lay.name}"
        out = train_layout(lay, run_dir, extra)
        res.append({"name": lay.name, **compare(out, ref)})
        del out
        _destroy_subgroups()
    return res


def _destroy_subgroups() -> None:
    """Destroy every process group but the default one (each layout builds its own mesh and
    pipeline groups; hundreds of live gloo groups slow every later layout down). Collective."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    dist.barrier()
    for pg in list(c10d._world.pg_map):  # private registry: the only list of live groups
        if pg is not c10d.GroupMember.WORLD and pg is not dist.group.WORLD:
            dist.destroy_process_group(pg)


ERRORS = ("loss_err", "norm_err", "val_err", "param_err", "optim_err", "full_err")


def check(layout_name: str, records: list[dict], ref_keys: tuple[set, set], rtol) -> dict:
    """Assert one layout's per-rank records (index = rank) against ``rtol`` (a float, or a dict
    keyed by the names in :data:`ERRORS`) and bitwise copy equality; return the summary
    ``{"name", "world", worst errors}``. Raises AssertionError naming the layout, the quantity
    and the value."""
    worst = {k: max(r[k] for r in records) for k in ERRORS}
    for k, v in worst.items():
        tol = rtol[k] if isinstance(rtol, dict) else rtol
        assert v <= tol, f"{layout_name}: {k} {v:.3g} > {tol:g}"
    assert all(r["step_ok"] for r in records), f"{layout_name}: optimizer step count differs from one process"
    assert all(r["full_dtype_ok"] for r in records), f"{layout_name}: full_params() changes the parameter dtype"
    assert not any(r["missing_full"] for r in records), f"{layout_name}: full_params() lacks parameters"
    for r in records:
        assert not r["unknown_keys"], f"{layout_name}: keys not in the reference {r['unknown_keys'][:4]}"
    pkeys = set().union(*(r["param_keys"] for r in records))
    okeys = set().union(*(r["optim_keys"] for r in records))
    assert pkeys == ref_keys[0], f"{layout_name}: canonical parameters missing {sorted(ref_keys[0] - pkeys)[:4]}"
    assert okeys == ref_keys[1], f"{layout_name}: optimizer state missing {sorted(ref_keys[1] - okeys)[:4]}"
    seen: dict = {}
    for rank, r in enumerate(records):
        for key, dig in r["copies"].items():
            first = seen.setdefault(key, (rank, dig))
            assert first[1] == dig, (f"{layout_name}: copies of {key[0]} differ between rank {first[0]} and "
                                     f"rank {rank} (key {key})")
    return {"name": layout_name, "world": len(records), **worst}


def markdown(result: dict) -> str:
    """A Markdown report of a matrix run (the JSON that ``ZEROTRON_MATRIX_OUT`` writes)."""
    w = result["worst"]
    lines = [f"# Parity matrix ({result['mode']})", "",
             f"{result['checked']} of {result['valid']} valid layouts trained in fp64 against one process "
             f"({result['refused']} refused by config validation, each for a documented reason); "
             f"{result['seconds']:.0f} s on this machine.", "",
             "Worst relative error over all layouts: " + ", ".join(f"{k} {v:.2g}" for k, v in w.items())
             + f" (bound {FP64_RTOL:g}).", "",
             "| layout | world | loss | grad norm | val loss | params | Adam state | full_params |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["layouts"]:
        lines.append(f"| {s['name']} | {s['world']} | " + " | ".join(f"{s[k]:.1e}" for k in ERRORS) + " |")
    reasons: dict = {}
    for name, msg in result.get("refusals", {}).items():
        reasons.setdefault(msg.split(";")[0], []).append(name)
    lines += ["", "## Refused", "", "| reason (config message) | layouts |", "|---|---:|"]
    lines += [f"| {r} | {len(n)} |" for r, n in sorted(reasons.items(), key=lambda x: -len(x[1]))]
    return "\n".join(lines) + "\n"
