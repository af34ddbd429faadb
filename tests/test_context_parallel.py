"""Context parallelism in the engine (issue 28): the all-gather attention against dense causal
attention (fp64, forward and backward, GQA), the hooks a cp model runs with, the plan's refusals,
and checkpoints resharded across cp. The layouts themselves (cp x dp / ZeRO / FSDP2 / tp, GPT-2 and
Llama) are trained against one process in the parity matrix (``tests/test_parity_matrix.py``)."""
import os

import pytest
import torch

from zerotron.config import ConfigError
from zerotron.plan import CP_IMPLS, build_plan
from zerotron.testing import assert_params_close, run_ranks, tiny_config

SMALL = {"model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 16}
LLAMA = {"model.arch": "llama", "model.n_kv_head": 2, "model.intermediate_size": 64}


def _allgather_vs_dense(cp_expected):
    """Every cp rank: allgather_attention of its zigzag chunks against dense causal attention over the
    whole sequence, values and the gradients of q, k, v (GQA: 4 query heads on 2 kv heads)."""
    from zerotron.distributed import comm
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.models.base import causal_attention
    from zerotron.parallel.context.attention import context_attention
    from zerotron.parallel.context.split import split_sequence

    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64) for h in (H, Hkv, Hkv))
    w = torch.randn(B, H, T, D, dtype=torch.float64)  # a loss that weighs every output element
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    (causal_attention(qd, kd, vd, 0.0) * w).sum().backward()
    dense = causal_attention(q, k, v, 0.0)
    mesh = Mesh(ParallelDims(torch.distributed.get_world_size(), 1, 1, 1, 1, cp_expected), torch.device("cpu"))
    g, r, cp = mesh.group("cp"), mesh.local_rank("cp"), mesh.size("cp")
    ql, kl, vl = (split_sequence(t, cp, r, dim=2).requires_grad_() for t in (q, k, v))
    before = comm.STATS.total_bytes()
    out = context_attention(ql, kl, vl, g, "allgather")
    (out * split_sequence(w, cp, r, dim=2)).sum().backward()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    return {"out": rel(out.detach(), split_sequence(dense, cp, r, dim=2)),
            "dq": rel(ql.grad, split_sequence(qd.grad, cp, r, dim=2)),
            "dk": rel(kl.grad, split_sequence(kd.grad, cp, r, dim=2)),
            "dv": rel(vl.grad, split_sequence(vd.grad, cp, r, dim=2)),
            "bytes": comm.STATS.total_bytes() - before,
            "ops": sorted({f"{op}/{grp}/{tag}" for (op, grp, tag) in comm.STATS.bytes if tag == "cp_attn"})}


@pytest.mark.parametrize("cp", [2])
def test_allgather_attention_equals_dense(cp):
    res = run_ranks(_allgather_vs_dense, cp, cp, timeout_s=60)
    for r in res:
        for key in ("out", "dq", "dk", "dv"):
            assert r[key] <= 1e-13, (key, r[key])
        assert r["ops"] == ["all_gather/cp/cp_attn", "reduce_scatter/cp/cp_attn"], r["ops"]
    # K and V (B, H_kv, T, D) float64 gathered once forward, their gradients reduce-scattered once backward
    assert res[0]["bytes"] == 2 * 2 * (2 * 2 * 16 * 8 * 8)


def test_impls_are_the_plans():
    from zerotron.parallel.context.attention import IMPLS

    assert IMPLS == CP_IMPLS


def _plan(o, world):
    return build_plan(tiny_config({**SMALL, **o}), world)


@pytest.mark.parametrize("o,world,words", [
    ({"parallel.cp": 3}, 3, "divisible by 2*cp = 6"),
    ({"parallel.cp": 2, "parallel.pp": 2}, 4, None),  # the native pipeline runner: cp per stage
    ({"parallel.cp": 2, "parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe",
      "parallel.virtual_stages": 2}, 2, "parallel.pp_impl = threads"),
    ({"parallel.cp": 2, "parallel.pp": 2, "parallel.pp_impl": "torch"}, 4, "parallel.pp_impl = torch"),
    ({"parallel.cp": 2, "model.dropout": 0.1}, 2, None),  # coordinate-function attention dropout (every impl)
    ({"parallel.cp": 2, "parallel.cp_impl": "a2a", "model.dropout": 0.1}, 2, None),
    ({"parallel.cp": 2, "parallel.cp_impl": "allgather", "model.dropout": 0.1}, 2, None),
    ({"parallel.cp": 4, "parallel.cp_impl": "a2a", "parallel.tp": 2}, 8, "model.n_head / parallel.tp = 4 / 2 = 2"),
    ({"parallel.cp": 2, "parallel.cp_impl": "a2a", "parallel.tp": 2, **LLAMA}, 4, "model.n_kv_head / parallel.tp"),
    ({"parallel.cp": 2, "parallel.cp_impl": "rings"}, 2, "parallel.cp_impl must be one of"),
    ({"parallel.cp": 2, "parallel.tp": 2, "parallel.tp_impl": "dtensor"}, 4, "dp = pp = cp = 1"),
    ({"parallel.cp": 2, "parallel.dp": 1}, 4, "parallel.dp*tp*pp*cp"),
    ({"parallel.cp": 4, "parallel.tp": 2, "parallel.sequence_parallel": "true", "model.block_size": 8,
      "model.n_head": 2}, 8, None),
    ({"parallel.cp": 2, "parallel.cp_impl": "a2a", **LLAMA}, 2, None),
])
def test_plan_rules(o, world, words):
    if words is None:
        plan = _plan(o, world)
        assert plan.cp == o["parallel.cp"] and plan.dp * plan.tp * plan.cp * plan.pp == world
        return
    with pytest.raises(ConfigError) as e:
        _plan(o, world)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and "parallel.cp" in msg or "parallel." in msg, msg
    assert words in msg, msg


def test_dp_derived_with_cp():
    plan = _plan({"parallel.cp": 2, "parallel.tp": 2}, 8)
    assert (plan.dp, plan.cp, plan.tp) == (2, 2, 2)
    assert plan.layout()["cp"] == 2
    assert _plan({}, 2).cp == 1  # existing configs: cp 1


CKPT = {**SMALL, "model.n_layer": 2, "train.steps": 4, "train.global_batch": 4, "train.micro_batch": 2,
        "train.eval_every": 0, "checkpoint.save_final": "false", "train.grad_clip": 0.5, "train.dtype": "fp64",
        "checkpoint.every": 2, "checkpoint.keep": 0, "log.tensorboard": "false"}
CP2 = {"parallel.cp": 2, "parallel.cp_impl": "allgather"}  # world 2: dp 1, the batch group is the cp group


def _fit(overrides, run_dir, resume=False):
    from zerotron.train.trainer import Trainer

    tr = Trainer(tiny_config({**CKPT, **overrides}), run_dir, resume=resume)
    losses = []
    tr.fit(callback=lambda t, rec: losses.append(rec["loss"]))
    msd, _ = tr.strategy.state_dict(tr.optimizer)
    # numpy, not tensors: a rank's result crosses a multiprocessing queue
    return {"losses": losses, "params": {k: v.detach().double().cpu().numpy().copy() for k, v in msd.items()}}


def _keep_step(src, dst, step: int) -> None:
    import shutil

    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != f"step_{step}"])


def _close(out, ref, steps):
    assert len(out["losses"]) == len(steps)
    for a, b in zip(out["losses"], [ref["losses"][s] for s in steps]):
        assert abs(a - b) <= 1e-10 * abs(b), (out["losses"], ref["losses"])
    assert_params_close(out["params"], ref["params"], 1e-10)


def test_checkpoints_reshard_across_cp(tmp_path, data_cache, single_process):
    """cp replicas of every parameter are bitwise equal after 4 steps; a cp = 2 run's step-2 checkpoint resumes in one process (cp = 1) equal to
    the uninterrupted cp = 2 run, and a one-process checkpoint resumes at cp = 2 equal to the one
    process run (steps 3-4: losses and final parameters, rtol 1e-10)."""
    cache = {"data.cache_dir": data_cache}
    ranks = run_ranks(_fit, 2, {**CP2, **cache}, str(tmp_path / "cp2"), timeout_s=120)
    cp2 = ranks[0]
    for k, v in cp2["params"].items():  # the cp replicas of every (replicated) parameter: the same bits
        assert (v == ranks[1]["params"][k]).all() and ranks[0]["losses"] == ranks[1]["losses"], k
    import json

    rec = json.loads((tmp_path / "cp2" / "metrics.jsonl").read_text().splitlines()[0])
    # per step: 2 layers x 2 micro-batches, each all-gathering K and V (2 x 2 x 4 x 16 x 8 float64 in all)
    # forward and reduce-scattering their gradients backward, counted under the cp group's label (DDP
    # all-reduces the gradients over the batch group dp x cp, here the cp group too)
    kv = 2 * 2 * 4 * 16 * 8 * 8
    ops = rec["comm_bytes_by_op"]
    assert ops["all_gather/cp"] == ops["reduce_scatter/cp"] == 4 * kv and ops["all_reduce/cp"] > 0, ops
    _keep_step(tmp_path / "cp2", tmp_path / "to1", 2)
    _close(_fit(cache, str(tmp_path / "to1"), resume=True), cp2, [2, 3])
    one = _fit(cache, str(tmp_path / "one"))
    _close(cp2, one, [0, 1, 2, 3])  # cp 2 trains like one process
    _keep_step(tmp_path / "one", tmp_path / "to2", 2)
    _close(run_ranks(_fit, 2, {**CP2, **cache}, str(tmp_path / "to2"), True, timeout_s=120)[0], one, [2, 3])


def _union(ranks):
    """Rank 0's losses and the parameters of every rank's stages (a pipeline rank holds its own)."""
    return {"losses": ranks[0]["losses"], "params": {k: v for r in ranks for k, v in r["params"].items()}}


@pytest.mark.skipif(os.environ.get("ZEROTRON_CP_FULL") != "1", reason="~100 s on 2 cores: make test-cp")
def test_checkpoints_reshard_across_cp_under_pp(tmp_path, data_cache):
    """A cp 2 x pp 2 run's step-2 checkpoint resumes at cp 1 x pp 2 and at cp 2 x pp 1 equal to the
    uninterrupted cp 2 x pp 2 run (steps 3-4: losses and final parameters, rtol 1e-10). Three
    trainings on 4 + 2 + 2 processes: ``ZEROTRON_CP_FULL=1`` (``make test-cp``)."""
    cache = {"data.cache_dir": data_cache}
    ref = _union(run_ranks(_fit, 4, {**CP2, **cache, "parallel.pp": 2}, str(tmp_path / "cp2pp2"), timeout_s=180))
    for name, over in (("cp1pp2", {"parallel.pp": 2}), ("cp2pp1", CP2)):
        _keep_step(tmp_path / "cp2pp2", tmp_path / name, 2)
        out = _union(run_ranks(_fit, 2, {**over, **cache}, str(tmp_path / name), True, timeout_s=180))
        assert set(out["params"]) == set(ref["params"]), name
        _close(out, ref, [2, 3])


def _memory(capsys, *argv):
    import json

    from zerotron.analysis.memory_cli import memory_main

    assert memory_main(["--model", "gpt2", "--dp", "2", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_cp(capsys):
    """``zerotron memory --cp C``: the activations of seq / C tokens per rank (the cp = 1 estimate at
    seq / C), ZeRO states sharded over dp x C; a seq the zigzag split cannot take is refused."""
    one, two, half = (_memory(capsys, "--seq", "1024"), _memory(capsys, "--seq", "1024", "--cp", "2"),
                      _memory(capsys, "--seq", "512"))
    assert two["activations"]["max_bytes"] == half["activations"]["max_bytes"] < 0.6 * one["activations"]["max_bytes"]
    assert two["stages"][3]["total_bytes"] == _memory(capsys, "--dp", "4")["stages"][3]["total_bytes"]
    from zerotron.analysis.memory_cli import memory_main

    assert memory_main(["--model", "gpt2", "--dp", "2", "--seq", "1020", "--cp", "4"]) == 2
    assert "--seq 1020 is not divisible by 2*cp = 8" in capsys.readouterr().err
