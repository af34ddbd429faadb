"""HSDP (``parallel.dp_replicate``): dp 4 = 2 replicas x 2 shards for native ZeRO-2/3 and hierarchical
DDP -- parity with one process (fp64), communication bytes per step *per group* equal the theory
of ``parallel.data.hsdp`` (the shard group runs the ZeRO collectives, the replicate group only one
all-reduce of each 1/S gradient shard per step, the flat dp group no gradient traffic), model-state
bytes equal the estimator with the state sharded by S (not dp), and a checkpoint written by HSDP
ZeRO-3 resumed by one process. Config validation refuses what HSDP does not run, with one line."""
import numpy as np
import pytest

from zerotron.config import ConfigError
from zerotron.distributed import comm
from zerotron.plan import build_plan
from zerotron.testing import assert_params_close, run_ranks, tiny_config

STEPS = 4
GLOBAL = 16
# n_embd 36: flat buffers of 15,840 / 360 elements and a 512 x 36 embedding (odd sizes: padding)
MODEL = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 36, "model.block_size": 32,
         "train.global_batch": GLOBAL, "train.steps": STEPS, "train.eval_every": 0,
         "train.grad_clip": 0.05, "checkpoint.save_final": "false", "train.lr": 3e-3, "train.dtype": "fp64"}
RTOL = 1e-10
E = 8  # fp64 bytes per element
DP, R = 4, 2
S = DP // R
HSDP = {"parallel.dp_replicate": R}
LAYOUTS = [
    {**HSDP, "parallel.zero_stage": 2, "train.micro_batch": 1},   # 4 micro-batches per rank
    {**HSDP, "parallel.zero_stage": 3, "train.micro_batch": 4},   # 1 micro-batch
    {**HSDP, "parallel.zero_stage": 3, "train.micro_batch": 2},   # 2 micro-batches
    {**HSDP, "parallel.zero_stage": 1, "train.micro_batch": 2},
    {**HSDP, "train.micro_batch": 1, "parallel.bucket_mb": 0.05},  # hierarchical DDP, several buckets
    {"parallel.zero_stage": 3, "train.micro_batch": 4},           # flat ZeRO-3 (the comparison)
]


def _train(overrides: dict, run_dir: str, resume: bool = False) -> dict:
    from zerotron.analysis.memory import model_state_bytes
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**MODEL, **overrides})
    tr = Trainer(cfg, run_dir, resume=resume)
    comm.STATS.reset()
    losses, norms = [], []
    tr.fit(callback=lambda t, rec: (losses.append(rec["loss"]), norms.append(rec["grad_norm"])))
    out = {"losses": losses, "norms": norms, "bytes": dict(comm.STATS.bytes)}
    msd, _ = tr.strategy.state_dict(tr.optimizer)
    out["params"] = {k: v.detach().double().clone().numpy() for k, v in msd.items()}
    s, p = tr.strategy, cfg.parallel
    if p.zero_stage and p.zero_impl == "native":
        out["measured"] = s.model_state_bytes(tr.optimizer)
        out["estimate"] = model_state_bytes(tr.model.num_params(), DP, p.zero_stage, "fp64",
                                            dp_replicate=p.dp_replicate)
        out["n_flats"] = len(s.all_flats)
        out["padded"] = sum(f.padded for f in s.all_flats)
        out["padded_blocks"] = sum(f.padded for fl in s.flats[1:] for f in fl)
        out["shard"] = sum(f.k for f in s.all_flats)
        out["group_sizes"] = (s.group.size(), s.dp_group.size())
    elif not p.zero_stage:
        out["buckets"] = [b.buffer.numel() for b in s.buckets]
    return out


def _many(tmp, cache, layouts):
    return [_train({**o, "data.cache_dir": cache}, f"{tmp}/run{i}") for i, o in enumerate(layouts)]


def _by(b: dict, op=None, group=None, tag=None) -> int:
    return sum(v for (o, g, t), v in b.items() if (op is None or o == op) and (group is None or g == group)
               and (tag is None or t == tag))


@pytest.fixture(scope="module")
def reference(data_cache, single_process, tmp_path_factory):
    return _train({"train.micro_batch": GLOBAL, "data.cache_dir": data_cache}, str(tmp_path_factory.mktemp("href")))


def test_hsdp_parity_comm_and_memory(reference, data_cache, tmp_path):
    runs = run_ranks(_many, DP, str(tmp_path), data_cache, LAYOUTS, join_timeout_s=900)
    for lay, out in zip(LAYOUTS, runs[0]):
        np.testing.assert_allclose(out["losses"], reference["losses"], rtol=RTOL, err_msg=str(lay))
        np.testing.assert_allclose(out["norms"], reference["norms"], rtol=RTOL, err_msg=str(lay))
        assert_params_close(out["params"], reference["params"], RTOL, str(lay))
    assert reference["norms"][0] > 0.05 * 3  # clipping active
    for i, lay in enumerate(LAYOUTS):
        for r in range(1, DP):  # identical on every rank (norm summed over the right groups only)
            assert runs[r][i]["norms"] == runs[0][i]["norms"], (lay, r)
            assert runs[r][i]["bytes"] == runs[0][i]["bytes"], (lay, r)
    flat_link = None
    for lay, out in zip(LAYOUTS, runs[0]):
        b, acc = out["bytes"], GLOBAL // (DP * lay["train.micro_batch"])
        stage = lay.get("parallel.zero_stage", 0)
        hsdp = lay.get("parallel.dp_replicate", 1) > 1
        # nothing of the gradients or parameters goes over the flat dp group with HSDP
        for tag in ("grad", "param", "grad_rep"):
            assert _by(b, group="dp", tag=tag) == (0 if hsdp or tag == "grad_rep" else _by(b, group="dp", tag=tag)), lay
        if stage:
            assert out["group_sizes"] == ((S, DP) if hsdp else (DP, DP)), lay
            g = "dp_shard" if hsdp else "dp"
            psi = E * out["padded"]
            rs = psi * (1 if stage == 1 else acc)
            ag = psi if stage < 3 else E * (2 * acc * out["padded_blocks"] + out["padded"] - out["padded_blocks"])
            assert _by(b, "reduce_scatter", g, "grad") == STEPS * rs, lay
            assert _by(b, "all_gather", g, "param") == STEPS * ag, lay
            # the replicate group: exactly one all-reduce of each 1/S shard per step, whatever acc
            assert _by(b, "all_reduce", "dp_rep", "grad_rep") == (STEPS * E * out["shard"] if hsdp else 0), lay
            assert _by(b, group="dp_rep") == _by(b, "all_reduce", "dp_rep", "grad_rep"), lay
            if hsdp:
                assert out["shard"] * S == out["padded"]
            # memory: the estimator with the state sharded over S (padding < 2 elements per flat per S)
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
                diff = out["measured"][key] - out["estimate"][key]
                assert 0 <= diff <= 2 * E * out["n_flats"] * DP, (lay, key, out["measured"], out["estimate"])
            if hsdp and stage == 3:
                # the ZeRO-3 traffic that crosses nodes in a flat layout now stays in the shard group
                assert _by(b, group="dp_rep") < _by(b, group="dp_shard") / 2
            if not hsdp:
                flat_link = out
        else:  # hierarchical DDP: RS + AG of each padded bucket in the shard group, AR of 1/S across
            psi = E * sum(out["buckets"])
            assert all(n % S == 0 for n in out["buckets"]) and len(out["buckets"]) > 2
            assert _by(b, "reduce_scatter", "dp_shard", "grad") == STEPS * psi, lay
            assert _by(b, "all_gather", "dp_shard", "grad") == STEPS * psi, lay
            assert _by(b, "all_reduce", "dp_rep", "grad_rep") == STEPS * psi // S, lay
            assert _by(b, "all_reduce", "dp", "grad") == 0, lay
    assert flat_link is not None
    # HSDP ZeRO-3 at acc 1 vs flat ZeRO-3: the same shard-group volume, moved to S ranks
    h3 = runs[0][1]
    assert h3["measured"]["total_bytes"] > flat_link["measured"]["total_bytes"]  # sharded by S = 2, not 4


CK = {**HSDP, "parallel.zero_stage": 3, "train.micro_batch": 2, "checkpoint.every": 2, "checkpoint.keep": 0}


SAVED = {"hsdp": {}, "fsdp2_hsdp": {"parallel.zero_impl": "fsdp2"}}  # native ZeRO-3, FSDP2 on its 2-D mesh


def _save(tmp, cache):
    return {name: _train({**CK, **o, "data.cache_dir": cache}, f"{tmp}/{name}") for name, o in SAVED.items()}


def test_hsdp_checkpoint_resumed_by_one_process(data_cache, single_process, tmp_path):
    """Replicas hold the same shards: each key is written once (DCP), and one process resumes."""
    import shutil

    full = run_ranks(_save, DP, str(tmp_path), data_cache)[0]
    for name in SAVED:
        dst = tmp_path / f"{name}_single"
        shutil.copytree(tmp_path / name, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_")
                                                                        and n != "step_2"])
        one = _train({"train.micro_batch": 4, "checkpoint.every": 2, "checkpoint.keep": 0,
                      "data.cache_dir": data_cache}, str(dst), resume=True)
        assert len(one["losses"]) == STEPS - 2
        np.testing.assert_allclose(one["losses"], full[name]["losses"][2:], rtol=RTOL, err_msg=name)
        assert_params_close(one["params"], full[name]["params"], RTOL, f"{name} -> one process")


@pytest.mark.parametrize("over,world,needle", [
    ({"parallel.dp_replicate": 3, "parallel.zero_stage": 3}, 4, "must be >= 1 and divide the dp degree"),
    ({"parallel.dp_replicate": 2, "parallel.dp_impl": "torch"}, 4, "dp_impl = native"),
    ({"parallel.dp_replicate": 2, "parallel.pp": 2, "parallel.zero_stage": 2, "parallel.zero_impl": "fsdp2"}, 8,
     "under pipeline parallelism runs with native DDP or native ZeRO"),
    ({"parallel.dp_replicate": 2, "parallel.pp": 2, "parallel.pp_impl": "torch"}, 8, "under pipeline parallelism"),
    ({"parallel.dp_replicate": 0}, 4, "dp_replicate"),
])
def test_hsdp_refusals_are_one_line(over, world, needle):
    with pytest.raises(ConfigError) as e:
        build_plan(tiny_config({**MODEL, "train.micro_batch": 1, **over}), world)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_hsdp_under_a_pipeline_with_native_ddp_is_planned():
    """pp 2 x dp 4 = 2 replicas x 2 shards with native DDP: a valid plan (its parity is in the matrix)."""
    plan = build_plan(tiny_config({**MODEL, "train.micro_batch": 1, "parallel.dp_replicate": 2,
                                   "parallel.pp": 2}), 8)
    assert (plan.runner, plan.sync, plan.dp_replicate, plan.dp_shard) == ("pipeline", "ddp", 2, 2)
    for z in (1, 2, 3):  # and with native ZeRO: the plain runner's driver on each pipeline rank
        plan = build_plan(tiny_config({**MODEL, "train.micro_batch": 1, "parallel.dp_replicate": 2,
                                       "parallel.pp": 2, "parallel.zero_stage": z}), 8)
        assert (plan.runner, plan.sync, plan.zero_stage, plan.dp_shard) == ("pipeline", "zero", z, 2)


PP_HSDP = [{**HSDP, "parallel.pp": 2, "parallel.zero_stage": 3, "train.micro_batch": 2},  # 1F1B, 2 micro-batches
           {**HSDP, "parallel.pp": 2, "parallel.zero_stage": 1, "train.micro_batch": 1,
            "parallel.pp_schedule": "zb-h1"}]


def _train_pp(overrides: dict, run_dir: str) -> dict:
    from zerotron.analysis.memory import model_state_bytes, stage_num_params
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**MODEL, **overrides})
    tr = Trainer(cfg, run_dir)
    comm.STATS.reset()
    losses, norms = [], []
    tr.fit(callback=lambda t, rec: (losses.append(rec["loss"]), norms.append(rec["grad_norm"])))
    s, z = tr.strategy, tr.strategy.zero
    msd, _ = s.state_dict(tr.optimizer)
    n_stage = stage_num_params(tr.model_cfg, pp=2, layer_counts=list(s.split))[tr.mesh.coords["pp"]]
    return {"losses": losses, "norms": norms, "bytes": dict(comm.STATS.bytes),
            "params": {k: v.detach().double().clone().numpy() for k, v in msd.items()},
            "measured": s.model_state_bytes(tr.optimizer)["total_bytes"], "n_flats": len(z.all_flats),
            "estimate": model_state_bytes(n_stage, DP, cfg.parallel.zero_stage, "fp64", dp_replicate=R)["total_bytes"],
            "shard": sum(f.k for f in z.all_flats), "group_sizes": (z.group.size(), z.dp_group.size())}


def _many_pp(tmp, cache):
    return [_train_pp({**o, "data.cache_dir": cache}, f"{tmp}/pp{i}") for i, o in enumerate(PP_HSDP)]


def test_hsdp_zero_under_a_pipeline(reference, data_cache, tmp_path):
    """pp 2 x dp 4 (= 2 replicas x 2 shards) native ZeRO-3 under 1F1B and ZeRO-1 under ZB-H1 on 8
    processes: one process's losses, norms and parameters (fp64); each stage's state sharded over the
    shard group (S = 2), so its per-rank model-state bytes equal the estimator's for that stage's
    parameters (``stage_num_params``) up to the flat buffers' padding; across the replicas exactly
    one all-reduce of each 1/S gradient shard per step, nothing over the flat dp group."""
    runs = run_ranks(_many_pp, 2 * DP, str(tmp_path), data_cache, join_timeout_s=900)
    for i, lay in enumerate(PP_HSDP):
        for r, out in enumerate(o[i] for o in runs):
            np.testing.assert_allclose(out["losses"], reference["losses"], rtol=RTOL, err_msg=str(lay))
            np.testing.assert_allclose(out["norms"], reference["norms"], rtol=RTOL, err_msg=str(lay))
            assert_params_close(out["params"], reference["params"], RTOL, f"{lay} rank {r}", True)
            assert out["group_sizes"] == (S, DP), lay
            assert _by(out["bytes"], "all_reduce", "dp_rep", "grad_rep") == STEPS * E * out["shard"], (lay, r)
            assert all(_by(out["bytes"], group="dp", tag=t) == 0 for t in ("grad", "param", "grad_rep")), lay
            if lay["parallel.zero_stage"] == 3:  # fp64: 8 + 8 + 16 bytes per element, < 1 element of padding per flat
                assert out["estimate"] <= out["measured"] < out["estimate"] + 32 * out["n_flats"], (lay, r, out)
