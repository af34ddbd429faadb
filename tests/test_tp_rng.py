"""Tensor-parallel dropout RNG: the tracker states ("replicated", "model-parallel") are checkpointed
per rank, so a dp2 x tp2 / pp2 x tp2 run with dropout resumed from step 3 is bitwise equal to the
uninterrupted run; the streams are seeded per (dp, pp) coordinate (replicated stream equal across
tp ranks, model-parallel stream distinct per tp rank); resuming at another tp degree re-seeds the
tracker with a message instead of failing.

One 4-process spawn."""
import contextlib
import hashlib
import io
import shutil

import pytest

from zerotron.testing import run_ranks, tiny_config

STEPS, SAVE_AT = 6, 3
BASE = {"train.steps": STEPS, "train.global_batch": 8, "train.micro_batch": 4, "train.eval_every": 0,
        "model.dropout": 0.1, "checkpoint.every": SAVE_AT, "checkpoint.keep": 0, "checkpoint.save_final": "false"}
DP2TP2 = {"parallel.tp": 2}                     # dp derived: 2
PP2TP2 = {"parallel.pp": 2, "parallel.tp": 2}


def _h(t) -> str:
    return hashlib.sha256(t.detach().float().clone().numpy().tobytes()).hexdigest()  # clone: numpy pins


def _tracker_digests(tracker) -> dict:
    return {name: hashlib.sha256(state.numpy().tobytes()).hexdigest() for name, state in tracker.get_states().items()}


def _train(overrides, run_dir, resume=False):
    """One Trainer run; per step losses; the tracker states right after set-up (fresh runs: the
    seeds) and at the end; digests of this rank's parameters and Adam state at the end; what the
    set-up printed."""
    from zerotron.parallel.tensor.transform import TrackedDropout
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**BASE, **overrides})
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tr = Trainer(cfg, run_dir, resume=resume)
    tracker = next(m.tracker for m in tr.strategy.module.modules() if isinstance(m, TrackedDropout))
    out = {"coords": {k: tr.mesh.coords[k] for k in ("pp", "dp", "tp")}, "start": _tracker_digests(tracker), "losses": [],
           "printed": printed.getvalue()}
    tr.fit(callback=lambda t, rec: out["losses"].append(rec["loss"]))
    out["end"] = _tracker_digests(tracker)
    out["params"] = [_h(p) for p in tr.strategy.parameters()]
    out["adam"] = [_h(v) for st in tr.optimizer.state.values() for v in st.values() if v.dim() > 0]
    return out


def _worker(tmp, cache):
    import torch.distributed as dist

    def copy_until(src, dst):
        if dist.get_rank() == 0:
            keep = f"step_{SAVE_AT}"
            shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != keep])
        dist.barrier()

    outs = {}
    for name, lay in (("dp2tp2", DP2TP2), ("pp2tp2", PP2TP2)):
        lay = {**lay, "data.cache_dir": cache}
        outs[name] = _train(lay, f"{tmp}/{name}")
        copy_until(f"{tmp}/{name}", f"{tmp}/{name}_resumed")
        outs[name + "_resumed"] = _train(lay, f"{tmp}/{name}_resumed", resume=True)
    # the dp2 x tp2 checkpoint resumed at tp 4: tracker states cannot map across tp degrees
    copy_until(f"{tmp}/dp2tp2", f"{tmp}/to_tp4")
    outs["to_tp4"] = _train({"parallel.tp": 4, "data.cache_dir": cache}, f"{tmp}/to_tp4", resume=True)
    return outs


@pytest.fixture(scope="module")
def runs(data_cache, tmp_path_factory):
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("tprng")), data_cache, join_timeout_s=900)


@pytest.mark.parametrize("name", ["dp2tp2", "pp2tp2"])
def test_resume_with_tp_dropout_is_bitwise(runs, name):
    for r, rank in enumerate(runs):
        full, resumed = rank[name], rank[name + "_resumed"]
        assert len(full["losses"]) == STEPS and len(resumed["losses"]) == STEPS - SAVE_AT
        assert resumed["losses"] == full["losses"][SAVE_AT:], (name, r)   # bitwise, every step after 3
        assert resumed["params"] == full["params"], (name, r)
        assert resumed["adam"] == full["adam"], (name, r)
        assert resumed["end"] == full["end"], (name, r)                   # tracker states themselves
        assert resumed["start"] != full["start"], (name, r)               # restored, not the step-0 seeds
        assert "re-seeded" not in resumed["printed"]
    assert runs[0][name]["end"] != runs[0][name]["start"]   # dropout drew from the tracker


@pytest.mark.parametrize("stream,at", [("replicated", "start"), ("replicated", "end"), ("model-parallel", "start"),
                                       ("model-parallel", "end")])
def test_tracker_streams_per_coordinate(runs, stream, at):
    for name, other in (("dp2tp2", "dp"), ("pp2tp2", "pp")):
        by = {tuple(sorted(r[name]["coords"].items())): r[name][at][stream] for r in runs}
        assert len(by) == 4
        for key, d in by.items():
            c = dict(key)
            tp_peer = tuple(sorted({**c, "tp": 1 - c["tp"]}.items()))
            other_peer = tuple(sorted({**c, other: 1 - c[other]}.items()))
            if stream == "replicated":   # the same masks on both tp ranks of a (dp, pp) coordinate
                assert by[tp_peer] == d, (name, c)
            else:                        # different masks on the tp ranks (sharded regions)
                assert by[tp_peer] != d, (name, c)
            assert by[other_peer] != d, (name, stream, c)   # every dp replica / pp stage its own masks


def test_resume_at_other_tp_degree_reseeds(runs):
    outs = [r["to_tp4"] for r in runs]
    for r, out in enumerate(outs):
        assert len(out["losses"]) == STEPS - SAVE_AT
        assert "re-seeded" in out["printed"] and "tp 2" in out["printed"] and "tp 4" in out["printed"], out["printed"]
        assert out["start"] != runs[r]["dp2tp2"]["start"]    # from train.seed + step, not the step-0 seeds
    assert len({o["end"]["replicated"] for o in outs}) == 1   # still one replicated stream over tp 4
    assert len({o["end"]["model-parallel"] for o in outs}) == 4


def test_seeds_distinct_per_coordinate_and_restore_rules():
    import torch

    from zerotron.parallel.tensor.transform import (
        MODEL_PARALLEL,
        REPLICATED,
        RNGStatesTracker,
        restore_tracker,
        seed_tracker,
        tp_rng_seeds,
        tracker_checkpoint_state,
    )

    grid = [(t, d, p) for t in range(4) for d in range(3) for p in range(3)]
    seeds = {c: tp_rng_seeds(1337, *c) for c in grid}
    assert all(seeds[(t, d, p)][REPLICATED] == seeds[(0, d, p)][REPLICATED] for t, d, p in grid)
    distinct = {s[REPLICATED] for s in seeds.values()} | {s[MODEL_PARALLEL] for s in seeds.values()}
    assert len(distinct) == 3 * 3 + len(grid)       # no stream shared by two coordinates
    assert tp_rng_seeds(1337, 1) == {REPLICATED: 1337, MODEL_PARALLEL: 1337 + 2718 + 1}  # plain tp unchanged
    for bad in ((-1, 0, 0), (0, 2**16, 0), (0, 0, 2**15)):
        with pytest.raises(ValueError):
            tp_rng_seeds(0, *bad)

    def tracker(tp_rank, seed=5):
        tr = RNGStatesTracker()
        tr.seed, tr.coords = seed, {"tp": 2, "tp_rank": tp_rank, "dp_rank": 0, "pp_rank": 0}
        seed_tracker(tr, seed)
        return tr

    a = tracker(1)
    with a.fork(REPLICATED):
        torch.rand(3)
    saved = tracker_checkpoint_state(a)
    b = tracker(1)
    assert restore_tracker(b, saved, 4) is None
    assert all(torch.equal(b.states[k], a.states[k]) for k in a.states)
    c = tracker(0)                                      # another coordinate: re-seeded from seed + step
    msg = restore_tracker(c, saved, 4)
    assert "re-seeded" in msg and "step 4" in msg and "\n" not in msg
    assert all(torch.equal(c.states[k], tracker(0, seed=9).states[k]) for k in c.states)
    assert "no tensor-parallel RNG state" in restore_tracker(tracker(0), None, 4)
