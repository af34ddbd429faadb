"""Pipeline x FSDP2 (``parallel.zero_impl = fsdp2`` under ``parallel.pp = 2``, the per-stage driver
``parallel.pipeline.stage_sync.StageFSDP2``), GPT-2 with its tied embedding/head: pp 2 x dp 2 ZeRO-3
under 1F1B trains like one process (fp64), each rank holds 1/dp of its stage's model state (the
``model_state_breakdown`` of metrics.jsonl equals the estimator for that stage's parameters), and
its checkpoints (the canonical dense state FSDP2 gathers) resume in the same layout and in one
process, equal to the uninterrupted run. The parity matrix has the other schedules and ZeRO-2."""
import json
import shutil

import numpy as np

from zerotron.testing import assert_params_close, run_ranks, tiny_config

STEPS = 4
GLOBAL = 16
DP = 2
RTOL = 1e-10
MODEL = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 32,
         "train.global_batch": GLOBAL, "train.steps": STEPS, "train.eval_every": 0, "train.grad_clip": 0.05,
         "checkpoint.save_final": "false", "train.lr": 3e-3, "train.dtype": "fp64"}
PP_FSDP2 = {"parallel.pp": 2, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2", "train.micro_batch": 2,
            "parallel.pp_schedule": "1f1b", "parallel.pp_split": "even", "checkpoint.every": 2, "checkpoint.keep": 0}


def _train(overrides: dict, run_dir: str, resume: bool = False) -> dict:
    from zerotron.analysis.memory import model_state_bytes, stage_num_params
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**MODEL, **overrides})
    tr = Trainer(cfg, run_dir, resume=resume)
    losses, norms, breakdown = [], [], []

    def cb(t, rec):
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        breakdown.append(rec["model_state_breakdown"])

    tr.fit(callback=cb)
    msd, _ = tr.strategy.state_dict(tr.optimizer)
    out = {"losses": losses, "norms": norms, "breakdown": breakdown, "coords": dict(tr.mesh.coords),
           "params": {k: v.detach().double().clone().numpy() for k, v in msd.items()}}
    if cfg.parallel.pp > 1:
        s = tr.strategy
        n_stage = stage_num_params(tr.model_cfg, pp=2, layer_counts=list(s.split))[tr.mesh.coords["pp"]]
        out["estimate"] = model_state_bytes(n_stage, DP, 3, "fp64")
        out["unsharded"] = model_state_bytes(n_stage, 1, 3, "fp64")["total_bytes"]
    return out


def _pp_runs(tmp: str, cache: str) -> dict:
    """The uninterrupted pp2 x dp2 run (checkpoints at steps 2 and 4), then the same layout resumed
    from step 2 in a copy of its run directory."""
    import torch.distributed as dist

    full = _train({**PP_FSDP2, "data.cache_dir": cache}, f"{tmp}/full")
    if dist.get_rank() == 0:
        shutil.copytree(f"{tmp}/full", f"{tmp}/resumed",
                        ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != "step_2"])
    dist.barrier()
    resumed = _train({**PP_FSDP2, "data.cache_dir": cache}, f"{tmp}/resumed", resume=True)
    return {"full": full, "resumed": resumed}


def test_pipeline_fsdp2_parity_memory_and_checkpoints(data_cache, single_process, tmp_path):
    ref = _train({"train.micro_batch": GLOBAL, "data.cache_dir": data_cache}, str(tmp_path / "ref"))
    assert ref["norms"][0] > 0.05 * 3  # clipping active
    runs = run_ranks(_pp_runs, 4, str(tmp_path), data_cache, join_timeout_s=900)
    for r, out in enumerate(runs):
        full, resumed = out["full"], out["resumed"]
        np.testing.assert_allclose(full["losses"], ref["losses"], rtol=RTOL, err_msg=f"rank {r}")
        np.testing.assert_allclose(full["norms"], ref["norms"], rtol=RTOL, err_msg=f"rank {r}")
        assert_params_close(full["params"], ref["params"], RTOL, f"pp2 x fsdp2 rank {r}", True)
        # each rank holds 1/dp of its stage's parameters, gradients and Adam state (every dim 0 even)
        for rec in full["breakdown"]:
            for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "total_bytes"):
                assert rec[key] == full["estimate"][key], (r, key, rec, full["estimate"])
        assert 2 * full["breakdown"][-1]["total_bytes"] == full["unsharded"]
        # resumed from step 2 in the same layout: the last two steps of the uninterrupted run
        assert len(resumed["losses"]) == STEPS - 2
        np.testing.assert_allclose(resumed["losses"], full["losses"][2:], rtol=RTOL, err_msg=f"rank {r}")
        assert_params_close(resumed["params"], full["params"], RTOL, f"pp2 x fsdp2 resumed, rank {r}", True)
    assert {tuple(sorted(o["full"]["coords"].items())) for o in runs}.__len__() == 4
    # metrics.jsonl (rank 0: pp 0, dp 0) carries the same sharded breakdown
    with open(tmp_path / "full" / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    rank0 = next(o["full"] for o in runs if o["full"]["coords"]["pp"] == 0 and o["full"]["coords"]["dp"] == 0)
    assert [x["model_state_breakdown"] for x in recs if "model_state_breakdown" in x] == rank0["breakdown"]
    # one process resumes the pp2 x FSDP2 checkpoint of step 2 (the canonical dense state)
    dst = tmp_path / "single"
    shutil.copytree(tmp_path / "full", dst, ignore=lambda d, names: [n for n in names if n.startswith("step_")
                                                                      and n != "step_2"])
    one = _train({"train.micro_batch": GLOBAL, "checkpoint.every": 2, "checkpoint.keep": 0,
                  "data.cache_dir": data_cache}, str(dst), resume=True)
    assert len(one["losses"]) == STEPS - 2
    np.testing.assert_allclose(one["losses"], runs[0]["full"]["losses"][2:], rtol=RTOL)
    whole = {k: v for o in runs for k, v in o["full"]["params"].items()}  # both stages' canonical state
    assert_params_close(one["params"], whole, RTOL, "pp2 x fsdp2 -> one process")
    assert_params_close(one["params"], ref["params"], RTOL, "pp2 x fsdp2 -> one process vs uninterrupted")
