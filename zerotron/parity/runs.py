"""Running the parity matrix: train a layout through the real Trainer, compare it with the
single-process reference, check the copies, and report (see the package docstring)."""
from __future__ import annotations

import contextlib
import gc
import hashlib
import multiprocessing

from zerotron.distributed.mesh import clear_dtensor_caches, release_destroyed_groups
from zerotron.parity.space import FACTORS, FP64_RTOL, Layout, config_for


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
    dp_sharded = (getattr(strategy, "stage", 0) == 3 or "FSDP2Strategy" in {t.__name__ for t in type(strategy).__mro__}
                  or getattr(strategy, "fsdp2", None) is not None)  # FSDP2 under a pipeline
    shard = c["shard"]  # dp_shard x cp coordinate; HSDP: replicas of one shard must hold the same bits
    out = {}
    for name, p in strategy.module.named_parameters(remove_duplicate=False):
        d = _digest(p)
        if not d:
            continue
        ep_shard = getattr(p, "ep_shard", None)  # expert parallelism: a range of experts per ep rank
        where = shard if dp_sharded else None
        if ep_shard:  # (FSDP2: that range's dp shard too)
            where = ("ep",) + tuple(ep_shard) + ((shard,) if dp_sharded else ())
        key = (name, c["tp"] if is_tp_sharded(p) else None, where)
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
    # parameters the reference never stepped (LoRA's frozen base): bitwise the reference's
    # (a tied alias, e.g. lm_head.weight = wte.weight, has no optimizer state of its own under its
    # name but the value of a stepped parameter: not frozen)
    stepped = [ref["params"][j] for j in ref["optim"] if j in ref["params"]]
    unstepped = sorted(k for k, v in msd.items() if k in ref["params"] and k not in ref["optim"]
                       and not any(r.shape == ref["params"][k].shape and torch.equal(r, ref["params"][k])
                                   for r in stepped)
                       and not torch.equal(v.to(ref["params"][k].dtype).cpu(), ref["params"][k]))
    oerr, step_ok = 0.0, True
    for fqn, st in osd["state"].items():
        rs = ref["optim"][fqn]
        for k in ("exp_avg", "exp_avg_sq"):
            oerr = max(oerr, _rel(st[k], rs[k]))
        step_ok &= float(torch.as_tensor(st["step"])) == float(torch.as_tensor(rs["step"]))
    return {"param_err": perr, "optim_err": oerr, "step_ok": step_ok,
            "param_keys": sorted(msd), "optim_keys": sorted(osd["state"]), "unstepped_changed": unstepped,
            "unknown_keys": sorted((set(msd) - set(ref["params"])) | (set(osd["state"]) - set(ref["optim"])))}


class MeshCache:
    """The process groups of the layouts of one spawn, built once per mesh shape: ``get(dims,
    device)`` returns the :class:`~zerotron.distributed.mesh.Mesh` of ``dims``
    (a ``ParallelDims``), building it (collective) the first time; :attr:`groups` holds the process
    groups the cached meshes own, which :func:`destroy_subgroups` keeps between layouts. Building a
    mesh is one gloo rendezvous per group and axis (a world-8 mesh: a dozen groups) and a layout's
    numbers do not depend on which group objects carry its collectives, only on their members
    and order, which the dims fix. Every rank must ask for the same dims in the same order."""

    def __init__(self):
        self.meshes: dict = {}
        self.groups: set = set()

    def get(self, dims, device):
        from torch.distributed import distributed_c10d as c10d

        from zerotron.distributed.mesh import Mesh

        if dims not in self.meshes:
            before = set(c10d._world.pg_map)  # private registry: the only list of live groups
            self.meshes[dims] = Mesh(dims, device)
            self.groups |= set(c10d._world.pg_map) - before
        return self.meshes[dims]


def train_layout(layout: Layout, run_dir: str, extra: dict | None = None, meshes: MeshCache | None = None) -> dict:
    """Train ``layout`` in this process group (every rank calls it). Returns per-step ``losses``,
    ``norms``, ``val`` ({step: val_loss}), the canonical ``msd``/``osd`` (this rank's part), the
    rank's ``coords`` and ``copies`` (see :func:`_copies`). ``meshes``: process groups shared with
    earlier layouts of the same mesh shape (:class:`MeshCache`); None builds this layout's own.
    Collective."""
    from zerotron.distributed.mesh import init_distributed
    from zerotron.plan import build_plan
    from zerotron.train.setup import train_device
    from zerotron.train.trainer import Trainer

    cfg = config_for(layout, extra)
    if meshes is None:
        tr = Trainer(cfg, run_dir)
    else:
        _, world, device = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s, train_device(cfg))
        plan = build_plan(cfg, world)
        tr = Trainer(cfg, run_dir, plan=plan, mesh=meshes.get(plan.dims, device))
    out = {"losses": [], "norms": [], "val": {}, "aux": []}

    def cb(t, rec):
        out["losses"].append(rec["loss"])
        out["norms"].append(rec["grad_norm"])
        if "moe_aux_loss" in rec:  # MoE: the router's auxiliary losses (load balancing, z)
            out["aux"] += [rec["moe_aux_loss"], rec["moe_z_loss"]]
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


@contextlib.contextmanager
def _as_a_rank():
    """Train in this process as a run_ranks rank does: torch on one intra-op thread (on a loaded
    machine two threads per process spin against the other processes: the single-process reference
    took 24 s instead of ~2), and the objects alive before (a pytest process holds millions) left out
    of the garbage collections between layouts (``gc.freeze``, undone at the end). Restores both."""
    import torch

    threads, frozen = torch.get_num_threads(), gc.get_freeze_count() == 0
    torch.set_num_threads(1)
    if frozen:
        gc.freeze()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if frozen:
            gc.unfreeze()


def reference(run_dir: str, extra: dict | None = None) -> dict:
    """The single-process run of the matrix configuration (world size 1, one micro-batch per step):
    losses, norms, val, and the canonical state as ``{"params": {fqn: tensor}, "optim": {fqn:
    {exp_avg, exp_avg_sq, step}}}`` (CPU tensors). Needs a world-size-1 process group."""
    with _as_a_rank():
        out = train_layout(Layout("ddp", 1, 1, False, 1, None, 1), run_dir, extra)
    clone = lambda v: v.detach().cpu().clone() if hasattr(v, "detach") else v  # noqa: E731
    return {"losses": out["losses"], "norms": out["norms"], "val": out["val"], "aux": out["aux"],
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
         "aux_err": _rel_list(out.get("aux", []), ref.get("aux", [])),
         "val_err": _rel_list([out["val"].get(s, float("nan")) for s in vsteps], [ref["val"][s] for s in vsteps]),
         "coords": out["coords"], "copies": out["copies"]}
    e.update(_state_errors(out["msd"], out["osd"], ref))
    full = out["full"] if out["full"] is not None else {k: v for k, v in ref["params"].items()}
    e["missing_full"] = sorted(set(ref["params"]) - set(full))
    e["full_err"] = max((_rel(full[k], v) for k, v in ref["params"].items() if k in full), default=0.0)
    e["full_dtype_ok"] = all(v.dtype == ref["params"][k].dtype for k, v in full.items() if k in ref["params"])
    return e


def run_many(layouts: list[dict], ref_path: str, tmp: str, extra: dict | None = None,
             meshes: MeshCache | None = None) -> list[dict]:
    """Worker body (every rank of one spawn): train each layout (given as ``Layout.as_dict()``),
    compare it with the reference saved at ``ref_path`` (``torch.save`` of :func:`reference`),
    and return the per-rank error records (small: no tensors), one per layout. The layouts of one
    mesh shape share its process groups (``meshes``, a :class:`MeshCache`; None: one for this call,
    destroyed at its end); every other group a layout builds is destroyed after it. Collective:
    an exception (all ranks raise together on a config error) ends the spawn."""
    import torch

    ref = torch.load(ref_path, weights_only=False)
    own = meshes is None
    meshes = MeshCache() if own else meshes
    res = []
    with _as_a_rank():
        for d in layouts:
            lay = Layout(**{k: d[k] for k in FACTORS}, doc_mask=d.get("doc_mask", False), ep=d.get("ep", 1),
                         lora=d.get("lora", False), offload=d.get("offload", "none"))
            run_dir = f"{tmp}/{lay.name}"
            out = train_layout(lay, run_dir, extra, meshes)
            res.append({"name": lay.name, **compare(out, ref)})
            del out
            destroy_subgroups(keep=meshes.groups)
        if own:
            destroy_subgroups()
    return res


def run_jobs(jobs: list[tuple[list[dict], str, str, dict | None]]) -> list[list[dict]]:
    """Worker body running several :func:`run_many` jobs ``(layouts, ref_path, tmp, extra)`` in one
    spawn (e.g. both model families' layouts of one world size: the ranks import torch once, and
    the layouts of one mesh shape share its process groups, :class:`MeshCache`).
    Returns one record list per job, in order."""
    meshes = MeshCache()
    out = [run_many(*job, meshes=meshes) for job in jobs]
    destroy_subgroups()
    return out


def destroy_subgroups(keep: set | frozenset = frozenset()) -> None:
    """Destroy every process group but the default one and those in ``keep`` (each layout builds
    its own pipeline groups, and its own mesh outside a :class:`MeshCache`; hundreds of live gloo
    groups slow every later layout down). Collective."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    dist.barrier()
    gone = set()
    for pg in list(c10d._world.pg_map):  # private registry: the only list of live groups
        if pg is not c10d.GroupMember.WORLD and pg is not dist.group.WORLD and pg not in keep:
            gone.add(c10d._world.pg_names.get(pg))
            dist.destroy_process_group(pg)
    release_destroyed_groups()
    gc.collect()  # the layout's objects in reference cycles hold its groups (a gloo group: 3 threads, one polling)
    if not keep or _meshes_name(gone):  # DTensor's caches name a destroyed group: forget them
        clear_dtensor_caches()
        gc.collect()
    if multiprocessing.parent_process() is not None:  # a rank process (run_ranks), not the test's own process:
        gc.freeze()  # what survived stays (imports, caches): the next layout's collection skips it (0.15-0.4 s each);
        # what dies later while frozen (the MeshCache's meshes, in cycles) waits for the pooled rank's
        # collection of everything after the job (testing_pool._pool_main: it holds destroyed groups' threads)


def _meshes_name(groups: set) -> bool:
    """Whether a DeviceMesh that survived this layout (the young objects after a collection: DTensor's
    caches keep the meshes of the specs they hold) names one of ``groups`` (process group names).
    DTensor's sharding caches compare meshes by shape and dimension names, not by their groups, so
    while the kept meshes (:class:`MeshCache`) are the only ones alive they stay valid across
    layouts (sharding propagation is most of an FSDP2 layout's Python time); a mesh over a
    destroyed group (e.g. ``DeviceMesh.from_group`` of a layout's own group) would make a later
    layout's cache hit name that group, so the caches are cleared then."""
    if not groups:
        return False
    from torch.distributed.device_mesh import DeviceMesh

    return any(isinstance(o, DeviceMesh) and set(getattr(o, "_dim_group_names", ())) & groups
               for o in gc.get_objects(generation=2))


ERRORS = ("loss_err", "norm_err", "aux_err", "val_err", "param_err", "optim_err", "full_err")


def check(layout_name: str, records: list[dict], ref_keys: tuple[set, set], rtol) -> dict:
    """Assert one layout's per-rank records (index = rank) against ``rtol`` (a float, or a dict
    keyed by the names in :data:`ERRORS`) and bitwise copy equality; return the summary
    ``{"name", "world", worst errors}``. Raises AssertionError naming the layout, the quantity
    and the value."""
    worst = {k: max(r[k] for r in records) for k in ERRORS}
    for k, v in worst.items():
        tol = rtol.get(k, rtol.get("loss_err")) if isinstance(rtol, dict) else rtol  # aux: as the losses
        assert v <= tol, f"{layout_name}: {k} {v:.3g} > {tol:g}"
    assert all(r["step_ok"] for r in records), f"{layout_name}: optimizer step count differs from one process"
    assert all(r["full_dtype_ok"] for r in records), f"{layout_name}: full_params() changes the parameter dtype"
    assert not any(r["missing_full"] for r in records), f"{layout_name}: full_params() lacks parameters"
    changed = sorted({k for r in records for k in r.get("unstepped_changed", [])})
    assert not changed, f"{layout_name}: parameters the reference never stepped changed (frozen?): {changed[:4]}"
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


def parity_worst(layouts: list[dict], ref: dict, tmp, extra: dict | None = None, world: int = 2) -> dict:
    """Train ``layouts`` (``parity.Layout.as_dict()`` records) on ``world`` spawned ranks against the
    single-process reference ``ref`` (:func:`reference`, saved under ``tmp``) and
    check each with :func:`check` at ``FP64_RTOL``. Returns ``{layout name:
    worst relative error over ERRORS}``; raises AssertionError naming the layout that fails."""
    from pathlib import Path

    import torch

    from zerotron.testing import run_ranks

    ref_path = str(Path(tmp) / "ref.pt")
    torch.save(ref, ref_path)
    per_rank = run_ranks(run_many, world, layouts, ref_path, str(Path(tmp) / f"w{world}"), extra, timeout_s=120)
    keys, worst = (set(ref["params"]), set(ref["optim"])), {}
    for i, d in enumerate(layouts):
        s = check(d["name"], [per_rank[r][i] for r in range(world)], keys, FP64_RTOL)
        worst[d["name"]] = max(s[k] for k in ERRORS)
    return worst


def read_progress(path: str) -> dict:
    """The records of a matrix run's progress file (JSON lines, one per checked layout, appended as
    each chunk finishes) keyed by layout name; ``{}`` when the file does not exist. A torn last line
    (the run was killed while appending it: no newline at its end) is cut off the file (one note),
    so its layout is checked again and the next append starts a line of its own. Raises ValueError (one line naming the file, the line and the fix) for any other
    damaged line (not JSON, not a record with a ``name``, or a passing record -- one without ``error`` --
    whose :data:`ERRORS` are not all finite numbers: such a layout would count as checked, and the
    report's worst errors would fail with a KeyError or take a NaN, only at the end of the run)."""
    import json
    import math
    import os

    done = {}
    if not os.path.exists(path):
        return done
    with open(path, "rb") as f:
        data = f.read()
    whole = data.rfind(b"\n") + 1  # bytes up to the last newline
    if data[whole:].strip():  # cut the torn line off, so the next append starts a line of its own
        os.truncate(path, whole)
        print(f"note: progress file {path}: dropped a torn last line (an interrupted append); its layout is "
              "checked again")
    lines = data[:whole].decode("utf-8", errors="replace").split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            done[rec["name"]] = rec
            if "error" not in rec:
                for k in ERRORS:
                    v = rec[k]
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                        raise ValueError(f"{k} is {v!r}, not a finite number")
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"progress file {path}, line {i}: not a layout record ({type(e).__name__}: {e}); "
                             "delete that line (its layout is checked again) or the file (all are)") from None
    return done


def markdown(result: dict) -> str:
    """A Markdown report of a matrix run (the JSON that ``ZEROTRON_MATRIX_OUT`` writes)."""
    w = result["worst"]
    lines = [f"# Parity matrix ({result['mode']})", "",
             f"{result['checked']} of {result['valid']} valid layouts trained in fp64 against one process "
             f"({result['refused']} refused by config validation, each for a documented reason); "
             f"{result['seconds']:.0f} s on this machine.", "",
             "Worst relative error over all layouts: " + ", ".join(f"{k} {v:.2g}" for k, v in w.items())
             + f" (bound {FP64_RTOL:g}).", "",
             "| layout | world | loss | grad norm | MoE aux losses | val loss | params | Adam state | full_params |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in result["layouts"]:
        lines.append(f"| {s['name']} | {s['world']} | " + " | ".join(f"{s[k]:.1e}" for k in ERRORS) + " |")
    reasons: dict = {}
    for name, msg in result.get("refusals", {}).items():
        reasons.setdefault(msg.split(";")[0], []).append(name)
    lines += ["", "## Refused", "", "| reason (config message) | layouts |", "|---|---:|"]
    lines += [f"| {r} | {len(n)} |" for r, n in sorted(reasons.items(), key=lambda x: -len(x[1]))]
    return "\n".join(lines) + "\n"
