"""``train.meta_init`` (zerotron.models.deferred): the model built on the meta device and only this
rank's tensor-parallel slices of its pipeline stages materialised, with the dense init's values.

* Exact: on 4 ranks, for every runner/synchroniser family, the strategy's checkpoint state after
  ``parallelize`` (the local slices, flat shards, DTensor shards) equals the dense build's bit for
  bit. (The global RNG after ``parallelize`` differs: a dense tensor-parallel layer's constructor
  draws its throw-away init on the CPU, a meta one does not; the trainer reseeds right after,
  ``seed + 1 + rank``, so no training draw sees the difference.)
* Construction memory: a dry run's set-up peak (MemTracker over the build and ``parallelize``) is
  this rank's parameters plus one full tensor, not the dense model.
"""
import torch

from zerotron.testing import run_ranks, tiny_config

WORLD = 4
BASE = {"train.micro_batch": 2, "train.global_batch": 8, "model.block_size": 32}
LAYOUTS = [
    ("ddp-tp2-pp2", {"parallel.tp": 2, "parallel.pp": 2}),
    ("zero3-dp2-tp2", {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero_stage": 3}),
    ("fsdp2-dp4", {"parallel.dp": 4, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}),
    ("llama-tp2-pp2-zero2", {"model.preset": "llama-tiny", "model.arch": "llama", "model.bias": "false",
                             "parallel.tp": 2, "parallel.pp": 2, "parallel.zero_stage": 2}),
]


def _local(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def _out_of_bounds(tensors) -> list:
    """The tensors of ``tensors`` that are not on the meta device and address more bytes than their
    storage holds (an op given one reads or writes memory it does not own): their shapes."""
    bad = []
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_meta or not t.numel():
            continue
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        if (t.storage_offset() + span) * t.element_size() > t.untyped_storage().nbytes():
            bad.append(tuple(t.shape))
    return bad


def _released(strategy) -> dict:
    """A pipeline strategy's parameters of the other ranks' stages: out of bounds at rest, while
    ``full_params`` is open and after it; whether they are meta tensors at rest; whether an op that
    would read them (a gloo broadcast, a copy out, an add to a real tensor, a gradient for an
    optimizer step) raises instead of touching memory. Collective over pp."""
    import torch

    from zerotron.distributed import comm

    dense = getattr(strategy, "dense", None)
    if dense is None or strategy.pp == 1:
        return {}
    own = {id(q) for q in strategy.module.parameters()}
    foreign = [q for q in dense.parameters() if id(q) not in own]
    out = {"n": len(foreign), "rest": _out_of_bounds(foreign), "meta": all(q.is_meta for q in foreign)}
    with strategy.full_params():
        out["open"] = _out_of_bounds(dense.parameters())
        out["open_meta"] = any(q.is_meta for q in dense.parameters())
    out["after"], out["meta_after"] = _out_of_bounds(foreign), all(q.is_meta for q in foreign)
    raised = []
    if not out["rest"] and not out["after"]:  # (with memory out of bounds these ops could crash the rank)
        q = foreign[0]
        ops = {"broadcast": lambda: comm.broadcast(q.data, src=0, group=strategy.pp_group),
               "read": lambda: q.detach().cpu(), "add": lambda: torch.ones(q.shape, dtype=q.dtype) + q,
               "grad": lambda: setattr(q, "grad", torch.ones(q.shape, dtype=q.dtype))}  # (an optimizer step's)
        for name, op in ops.items():
            try:
                op()
            except (RuntimeError, ValueError, NotImplementedError):
                raised.append(name)
    out["raised"] = raised
    return out


def _states(layouts):
    """Every rank: per layout, the dense and the deferred build's strategy state (model part) and
    its released parameters (:func:`_released`)."""
    import torch.distributed as dist

    from zerotron.analysis.dryrun import build_rank
    from zerotron.distributed.mesh import Mesh
    from zerotron.parity.runs import destroy_subgroups
    from zerotron.plan import build_plan

    out = {}
    for name, ov in layouts:
        got, released = [], {}
        for meta in (False, True):
            cfg = tiny_config({**BASE, **ov, "train.meta_init": str(meta).lower()})
            plan = build_plan(cfg, dist.get_world_size())
            mesh = Mesh(plan.dims, torch.device("cpu"))
            _, strategy, optimizer = build_rank(cfg, plan, mesh)
            msd, _ = strategy.state_dict(None)
            got.append({k: _local(v) for k, v in msd.items()})
            released[meta] = _released(strategy)
            del strategy, optimizer
            destroy_subgroups()
        dense, deferred = got
        out[name] = {"keys": sorted(dense) == sorted(deferred),
                     "unequal": sorted(k for k in dense if k in deferred and not torch.equal(dense[k], deferred[k])),
                     "n": len(dense), "released": released}
    return out


def test_deferred_init_equals_the_dense_build():
    """... and on a pipeline rank, dense and deferred build alike, the other stages' parameters are
    meta tensors outside ``full_params`` (never a shape over a storage without memory, which an op
    would read or write out of bounds), real while it is open, and an op given one raises."""
    res = run_ranks(_states, WORLD, LAYOUTS, join_timeout_s=600)
    pipelines = 0
    for rank, per in enumerate(res):
        for name, r in per.items():
            assert r["n"] > 0 and r["keys"], (rank, name, r)
            assert r["unequal"] == [], (rank, name, r)
            for meta, rel in r["released"].items():
                if not rel:
                    continue
                pipelines += 1
                where = (rank, name, "meta_init" if meta else "dense")
                assert rel["n"] > 0 and rel["rest"] == [] and rel["after"] == [], (where, rel)
                assert rel["meta"] and rel["meta_after"], (where, rel)
                assert rel["open"] == [] and not rel["open_meta"], (where, rel)
                assert rel["raised"] == ["broadcast", "read", "add", "grad"], (where, rel)
    assert pipelines == 2 * WORLD * 2  # two pp layouts, each built dense and deferred, on every rank


def test_construction_rss_is_the_local_share():
    """Real tensors, rank 0 of 8 (torch's fake process group), tp 2 x pp 4 of a GPT-2 shape of
    ~110M parameters (440 MB fp32; rank 0 keeps 2 of 8 blocks' tp half and half the embedding,
    ~70 MB, plus DDP's gradient buckets of the same size): the construction's peak RSS growth with
    ``train.meta_init`` is under 60 % of the dense build's, which is at least the whole model.
    Fresh processes (max RSS is per process)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ov = ["--config", "configs/tiny.toml", "--model.n_embd", "1024", "--model.n_head", "8", "--model.n_layer", "8",
          "--model.vocab_size", "8192", "--model.block_size", "64", "--parallel.tp", "2", "--parallel.pp", "4",
          "--train.global_batch", "4"]
    out = {}
    for meta in ("true", "false"):
        r = subprocess.run([sys.executable, str(root / "benchmarks" / "meta_init_rss.py"), "--world", "8",
                            "--meta", meta, *ov], capture_output=True, text=True, timeout=300, cwd=root,
                           env={**os.environ, "PYTHONPATH": str(root)})
        assert r.returncode == 0, r.stderr[-2000:]
        out[meta] = json.loads(r.stdout.strip().splitlines()[-1])
    dense_model = (8 * 12 * 1024 * 1024 + 8192 * 1024 + 64 * 1024) * 4
    m, d = out["true"], out["false"]
    grow_m, grow_d = m["rss_peak_bytes"] - m["rss_before_bytes"], d["rss_peak_bytes"] - d["rss_before_bytes"]
    assert m["params_bytes"] == d["params_bytes"] < dense_model / 4, out
    assert grow_d >= 0.9 * dense_model, out
    assert grow_m <= 0.6 * grow_d, (grow_m, grow_d, out)
