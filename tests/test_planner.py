"""`zerotron plan`: layout enumeration invariants, cost-model hand checks, ranking sanity,
calibration, JSON schema and errors. Pure arithmetic (no processes)."""

import json

import pytest

from zerotron.analysis.flops import gpt_num_params
from zerotron.analysis.memory import GB, model_state_bytes, parse_memory, stage_num_params
from zerotron.analysis.planner import (CostModel, calibrate, custom_hardware, evaluate, hardware,
                                       plan, plan_main)
from zerotron.models.gpt import preset_config

LAYOUT_KEYS = {"dp", "tp", "pp", "zero_stage", "schedule", "micro_batch", "recompute",
               "memory_bytes_per_gpu", "predicted_step_time_s", "predicted_tokens_per_s",
               "predicted_mfu"}


def _json(capsys, argv):
    code = plan_main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset, gpus, per_node, mem, batch, seq", [
    ("gpt2", 8, 8, 80 * GB, 64, 1024),
    ("gpt2-large", 8, 4, 24 * GB, 24, 1024),   # 20 heads: tp 8 impossible; batch 24 = 8 * 3
    ("7b", 16, 8, 80 * GB, 32, 2048),
])
def test_never_violates_divisibility_or_memory(preset, gpus, per_node, mem, batch, seq):
    cfg = preset_config(preset)
    res = plan(cfg, gpus, mem, batch, seq, CostModel(hardware("h100"), per_node))
    assert res["layouts"], res["dropped"]
    for r in res["layouts"]:
        assert r["dp"] * r["tp"] * r["pp"] == gpus
        assert cfg.n_head % r["tp"] == 0 and r["pp"] <= cfg.n_layer
        per_dp = batch // r["dp"]
        assert batch % r["dp"] == 0 and per_dp % r["micro_batch"] == 0
        assert r["micro_batch"] & (r["micro_batch"] - 1) == 0  # a power of two
        assert r["microbatches"] * r["micro_batch"] * r["dp"] == batch
        assert r["memory_bytes_per_gpu"] <= mem
        if r["schedule"] == "interleaved":
            assert r["microbatches"] % r["pp"] == 0
        assert (r["schedule"] == "none") == (r["pp"] == 1)
    times = [r["predicted_step_time_s"] for r in res["layouts"]]
    assert times == sorted(times)
    if preset == "gpt2-large":
        assert res["dropped"]["divisibility"] > 0  # tp = 8 (and batch % dp) meshes
        assert {r["tp"] for r in res["layouts"]} <= {1, 2, 4}


def test_memory_is_states_plus_activations_plus_overhead():
    from zerotron.analysis.activations import activation_bytes

    cfg = preset_config("gpt2")
    cm = CostModel(hardware("h100"), overhead=1_500_000_000)
    lay = dict(dp=2, tp=2, pp=2, zero_stage=1, schedule="1f1b", micro_batch=2, recompute="none")
    r = evaluate(cfg, lay, 1024, 32, cm)
    act = activation_bytes(cfg, 2, 1024, tp=2, pp=2, microbatches=8, dtype="bf16",
                           attention="flash")["per_rank_bytes"]
    states = [model_state_bytes(p, 2, 1, "bf16-mixed")["total_bytes"]
              for p in stage_num_params(cfg, 2, 2)]
    assert r["memory_bytes_per_gpu"] == max(s + a for s, a in zip(states, act)) + 1_500_000_000


def test_cost_model_hand_computed():
    cfg = preset_config("gpt2")
    h, L, V, S = 768, 12, 50257, 1024
    hw = hardware("h100")  # 989e12 FLOP/s, 450e9 x 0.8 = 360e9 B/s NVLink
    cm = CostModel(hw, compute_eff=0.5, launch_s=0.0)
    # pure dp = 2, ZeRO 0: compute of m = 4 micro-batches of 2 sequences, then one all-reduce
    r = evaluate(cfg, dict(dp=2, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=2,
                           recompute="none"), S, 16, cm)
    flops = 8 * S * (L * (72 * h * h + 12 * h * S) + 6 * h * V)
    psi = gpt_num_params(L, 12, h, V, 1024)
    t_dp = 2 * psi * (2 * (2 - 1) / 2) / 360e9
    assert r["predicted_step_time_s"] == pytest.approx(flops / (989e12 * 0.5) + t_dp, rel=1e-12)
    assert r["predicted_mfu"] == pytest.approx(
        (6 * psi + 12 * L * h * S) * 16 * S / (r["predicted_step_time_s"] * 2 * 989e12))
    # tp = 2: 4 all-reduces per layer and micro-batch of b*S*h*2 bytes, factor 2(t-1)/t = 1
    r2 = evaluate(cfg, dict(dp=1, tp=2, pp=1, zero_stage=0, schedule="none", micro_batch=2,
                            recompute="none"), S, 16, cm)
    assert r2["time_breakdown_s"]["tp_comm"] == pytest.approx(8 * L * 4 * 2 * S * h * 2 / 360e9)
    r2f = evaluate(cfg, dict(r2, recompute="full"), S, 16, cm)  # the recomputed forward: 6, not 4
    assert r2f["time_breakdown_s"]["tp_comm"] == pytest.approx(r2["time_breakdown_s"]["tp_comm"]
                                                               * 6 / 4)
    # pp = 4, 1F1B, m = 8: the bubble adds (p-1)/m of the busy time
    r4 = evaluate(cfg, dict(dp=1, tp=1, pp=4, zero_stage=0, schedule="1f1b", micro_batch=2,
                            recompute="none"), S, 16, cm)
    b = r4["time_breakdown_s"]
    busy = b["compute"] + b["pp_comm"] + b["tp_comm"] + b["overhead"]
    assert b["bubble"] == pytest.approx(busy * 3 / 8)
    # interleaved (v = 2) halves that bubble; full recompute adds one forward of the layers
    ri = evaluate(cfg, dict(dp=1, tp=1, pp=4, zero_stage=0, schedule="interleaved", micro_batch=2,
                            recompute="none"), S, 16, cm)["time_breakdown_s"]
    assert ri["bubble"] == pytest.approx((ri["compute"] + ri["pp_comm"]) * 3 / 16)
    rf = evaluate(cfg, dict(dp=2, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=2,
                            recompute="full"), S, 16, cm)
    extra = 8 * S * L * (24 * h * h + 4 * h * S) / (989e12 * 0.5)
    assert rf["time_breakdown_s"]["compute"] == pytest.approx(r["time_breakdown_s"]["compute"]
                                                              + extra)
    # ZeRO-3 moves 1.5x the bytes of an all-reduce per micro-batch (here m = 4)
    r3 = evaluate(cfg, dict(dp=2, tp=1, pp=1, zero_stage=3, schedule="none", micro_batch=2,
                            recompute="none"), S, 16, cm)
    assert r3["time_breakdown_s"]["dp_comm"] == pytest.approx(4 * 1.5 * t_dp)


def test_inter_node_links_used_when_groups_cross_nodes():
    cfg = preset_config("gpt2")
    cm = CostModel(hardware("h100"), gpus_per_node=2, launch_s=0.0)
    lay = dict(dp=1, tp=4, pp=1, zero_stage=0, schedule="none", micro_batch=1, recompute="none")
    cross = evaluate(cfg, lay, 1024, 4, cm)["time_breakdown_s"]["tp_comm"]
    inside = evaluate(cfg, lay, 1024, 4, CostModel(hardware("h100"), gpus_per_node=4,
                                                   launch_s=0.0))["time_breakdown_s"]["tp_comm"]
    assert cross == pytest.approx(inside * 360 / 40)  # 50 GB/s NIC vs 450 GB/s NVLink, x 0.8
    # dp ranks sit tp apart (rank order pp, dp, tp): dp=2 x tp=2 fits a 4-GPU node, not a 2-GPU one
    lay = dict(dp=2, tp=2, pp=1, zero_stage=0, schedule="none", micro_batch=1, recompute="none")
    dp_t = [evaluate(cfg, lay, 1024, 4, CostModel(hardware("h100"), gpus_per_node=k))
            ["time_breakdown_s"] for k in (2, 4)]
    assert dp_t[0]["dp_comm"] == pytest.approx(dp_t[1]["dp_comm"] * 360 / 40)
    assert dp_t[0]["tp_comm"] == pytest.approx(dp_t[1]["tp_comm"])  # tp stays inside a node


def test_deterministic(capsys):
    argv = ["--model", "gpt2-medium", "--gpus", "16", "--global-batch", "64", "--seq", "1024"]
    a, b = _json(capsys, argv), _json(capsys, argv)
    assert a == b and a[0] == 0
    assert plan_main(argv) == 0 and plan_main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[: len(out) // 2] == out[len(out) // 2:]


def test_gpt2_prefers_data_parallel_over_deep_pipeline(capsys):
    code, out = _json(capsys, ["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80GB",
                               "--global-batch", "64", "--seq", "1024", "--top", "1000"])
    assert code == 0
    best = out["layouts"][0]
    assert best["pp"] == 1 and best["tp"] <= 2 and best["dp"] >= 4
    pp8 = [r for r in out["layouts"] if r["pp"] == 8]
    assert pp8 and min(r["predicted_step_time_s"] for r in pp8) > best["predicted_step_time_s"]


def test_7b_on_80gb_needs_sharding(capsys):
    code, out = _json(capsys, ["--model", "7b", "--gpus", "8", "--gpu-mem", "80GB",
                               "--global-batch", "32", "--top", "100000"])
    assert code == 0 and out["dropped"]["memory"] > 0
    assert all(r["zero_stage"] > 0 or r["tp"] > 1 or r["pp"] > 1 for r in out["layouts"])
    # plain dp: 16 bytes/param of model states alone exceed 80 GB
    cfg = preset_config("7b")
    lay = dict(dp=8, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=1, recompute="full")
    assert evaluate(cfg, lay, 2048, 32, CostModel(hardware("h100")))["memory_bytes_per_gpu"] > 80 * GB
    # with too little memory nothing fits: exit code 1, empty list
    code, out = _json(capsys, ["--model", "7b", "--gpus", "8", "--gpu-mem", "8GB",
                               "--global-batch", "32"])
    assert code == 1 and out["layouts"] == []


def test_calibration_changes_intra_node_bandwidth(tmp_path, capsys):
    bench = {"topology": {"backend": "gloo"}, "results": [
        {"op": "all_reduce", "bytes": 4096, "time_s": 1e-4, "algbw_GBps": 9.0, "busbw_GBps": 9.0,
         "mode": "blocking"},
        {"op": "all_reduce", "bytes": 1 << 24, "time_s": 1e-2, "algbw_GBps": 7.0,
         "busbw_GBps": 7.0, "mode": "nonblocking"},  # blocking is preferred at equal size
        {"op": "all_reduce", "bytes": 1 << 24, "time_s": 1e-2, "algbw_GBps": 2.5,
         "busbw_GBps": 2.5, "mode": "blocking"},
        {"op": "all_gather", "bytes": 1 << 24, "time_s": 1e-2, "algbw_GBps": 6.0,
         "busbw_GBps": 3.0, "mode": "blocking"}]}
    hw = calibrate(hardware("h100"), bench)
    assert hw.intra["all_reduce"] == 2.5e9 and hw.intra["all_gather"] == 3.0e9
    assert hw.intra["p2p"] == 360e9 and hw.inter == hardware("h100").inter
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    argv = ["--model", "gpt2", "--gpus", "8", "--global-batch", "64", "--seq", "1024"]
    _, base = _json(capsys, argv)
    _, cal = _json(capsys, argv + ["--calibrate", str(path)])
    assert cal["assumptions"]["intra_node_busbw_GBps"]["all_reduce"] == 2.5
    assert base["assumptions"]["intra_node_busbw_GBps"]["all_reduce"] == 360.0
    assert cal["layouts"][0]["predicted_step_time_s"] > base["layouts"][0]["predicted_step_time_s"]
    with pytest.raises(ValueError, match="no busbw"):
        calibrate(hardware("h100"), {"results": []})


def test_custom_hardware_and_fp32_communication():
    """A measured CPU profile: custom peak, one busbw for every op (then calibrated); elem_bytes = 4
    (fp32 training) doubles every communication term and leaves compute alone."""
    hw = custom_hardware("cpu", 5e10, 24 * 2**30, 1e9)
    assert (hw.name, hw.peak_flops, hw.memory) == ("cpu", 5e10, 24 * 2**30)
    assert hw.intra == hw.inter == {op: 1e9 for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    cal = calibrate(hw, {"results": [{"op": "p2p", "bytes": 1 << 22, "busbw_GBps": 1.5}]})
    assert cal.intra["p2p"] == 1.5e9 and cal.intra["all_reduce"] == 1e9 and cal.inter == hw.inter
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, -1)):
        with pytest.raises(ValueError, match="must be > 0"):
            custom_hardware("cpu", *bad)
    cfg = preset_config("gpt2")
    for lay in (dict(dp=2, tp=1, pp=1, zero_stage=3), dict(dp=1, tp=2, pp=1, zero_stage=0),
                dict(dp=1, tp=1, pp=2, zero_stage=0)):
        lay.update(schedule="1f1b" if lay["pp"] > 1 else "none", micro_batch=2, recompute="none")
        b2, b4 = (evaluate(cfg, lay, 256, 8, CostModel(cal, gpus_per_node=2, elem_bytes=e))
                  ["time_breakdown_s"] for e in (2, 4))
        assert b4["compute"] == b2["compute"]
        for k in ("dp_comm", "tp_comm", "pp_comm"):
            assert b4[k] == pytest.approx(2 * b2[k])
        assert b2["dp_comm"] + b2["tp_comm"] + b2["pp_comm"] > 0


def test_json_schema_and_config_file(capsys):
    code, out = _json(capsys, ["--config", "configs/tiny.toml", "--gpus", "4",
                               "--gpus-per-node", "4", "--top", "3", "--supported-only"])
    assert code == 0 and set(out) == {"layouts", "dropped", "feasible", "assumptions"}
    assert 1 <= len(out["layouts"]) <= 3 and out["feasible"] >= len(out["layouts"])
    for r in out["layouts"]:
        assert LAYOUT_KEYS <= set(r)
        assert isinstance(r["memory_bytes_per_gpu"], int) and 0 < r["predicted_mfu"] < 1
        assert r["predicted_tokens_per_s"] == pytest.approx(8 * 64 / r["predicted_step_time_s"])
        assert r["pp"] == 1 or (r["tp"] == 1 and r["zero_stage"] == 0)
    assert set(out["dropped"]) >= {"memory", "divisibility"}
    assert out["assumptions"]["global_batch"] == 8 and out["assumptions"]["seq"] == 64


@pytest.mark.parametrize("argv, word", [
    (["--model", "nope", "--gpus", "8", "--global-batch", "8"], "nope"),
    (["--model", "gpt2", "--gpus", "12", "--gpus-per-node", "8", "--global-batch", "8"], "multiple"),
    (["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80XB", "--global-batch", "8"], "memory"),
    (["--model", "gpt2", "--gpus", "8", "--gpu-mem", "lots", "--global-batch", "8"], "memory"),
    (["--model", "gpt2", "--gpus", "8"], "global-batch"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--seq", "4096"], "block_size"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--calibrate", "/no/such.json"],
     "calibration"),
    (["--model", "gpt2", "--gpus", "0", "--global-batch", "8"], "gpus"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--gpu", "tpu"], "gpu"),
    (["--gpus", "8"], "model"),
])
def test_bad_inputs_return_2(argv, word, capsys):
    assert plan_main(argv) == 2
    assert word in capsys.readouterr().err


def test_bad_calibration_content(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"results": [{"op": "all_reduce", "busbw_GBps": 0}]}))
    for f in (bad, empty):
        assert plan_main(["--model", "gpt2", "--gpus", "8", "--global-batch", "8",
                          "--calibrate", str(f)]) == 2
        assert "calibration" in capsys.readouterr().err


def test_parse_memory_and_stage_params():
    assert parse_memory("80GB") == 80 * GB and parse_memory("80 GiB") == 80 * 2**30
    assert parse_memory("1.5TB") == 1_500_000_000_000
    for bad in ("80", "80XB", "-1GB", "0GB", ""):
        with pytest.raises(ValueError):
            parse_memory(bad)
    cfg = preset_config("gpt2")
    total = gpt_num_params(12, 12, 768, 50257, 1024)
    assert stage_num_params(cfg) == [total]
    # pp = 2: the last stage holds a tied copy of the token embedding
    assert sum(stage_num_params(cfg, pp=2)) == total + 50257 * 768
    two = stage_num_params(cfg, tp=2)[0]
    assert total / 2 < two < total / 2 + 1024 * 768 + 12 * 6 * 768 + 2 * 768  # replicated parts


def test_validate_plan_spearman_and_layout_map():
    from zerotron.bench import train as bt
    from zerotron.bench.validate_plan import planner_layout, ranks, spearman

    assert list(ranks([3.0, 1.0, 2.0, 1.0])) == [4.0, 1.5, 3.0, 1.5]  # ties: average rank
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9 ** 0.5)  # 4.5 / sqrt(4.5 * 5)
    for a, b in (([1, 2], [1, 2]), ([1, 2, 3], [1, 2]), ([1, 1, 1], [1, 2, 3])):
        with pytest.raises(ValueError):
            spearman(a, b)
    for name in bt.LAYOUTS:  # every bench layout has a planner counterpart on 2 ranks
        lay, sp = planner_layout(name, 2, 8)
        assert lay["dp"] * lay["tp"] * lay["pp"] == 2 and lay["micro_batch"] == 8 and sp == (name == "tp-sp")
        assert lay["schedule"] == (name[3:] if name.startswith("pp-") else "none")
    assert planner_layout("zero3", 2, 4)[0]["zero_stage"] == 3
    assert planner_layout("fsdp2-zero2", 2, 4)[0]["zero_stage"] == 2
    assert planner_layout("single", 1, 8)[0]["dp"] == 1 and planner_layout("bogus", 2, 8) is None


def test_validate_plan_end_to_end(tmp_path, capsys):
    """The recorded CPU bench (benchmarks/strategies_cpu.json) against a synthetic comm file, with a
    given peak (nothing timed): every measured layout is predicted, the report and JSON agree."""
    from pathlib import Path

    from zerotron.bench import validate_plan as vp

    root = Path(__file__).resolve().parent.parent
    comm = tmp_path / "comm.json"
    comm.write_text(json.dumps({"topology": {"world_size": 2}, "results": [
        {"op": op, "mode": "blocking", "bytes": 1 << 22, "busbw_GBps": 1.0} for op in
        ("all_reduce", "all_gather", "reduce_scatter", "p2p")]}))
    md, js = tmp_path / "v.md", tmp_path / "v.json"
    argv = ["--bench-train", str(root / "benchmarks" / "strategies_cpu.json"), "--bench-comm", str(comm),
            "--peak-flops", "1e11", "--out", str(md), "--json", str(js)]
    assert vp.main(argv) == 0
    out = json.loads(js.read_text())
    bench = [r for r in json.loads((root / "benchmarks" / "strategies_cpu.json").read_text()) if not r["skipped"]]
    assert [p["layout"] for p in out["layouts"]] == [r["layout"] for r in bench]
    assert out["hardware"]["peak_flops"] == 1e11 and out["hardware"]["busbw_GBps"]["p2p"] == 1.0
    assert -1 <= out["spearman"] <= 1 and out["spearman"] == out["spearman_variants"]["all"]
    assert out["spearman"] == pytest.approx(vp.spearman([p["predicted_tokens_per_s"] for p in out["layouts"]],
                                                        [r["tokens_per_s"] for r in bench]))
    by = {p["layout"]: p for p in out["layouts"]}
    assert by["dp"]["predicted_tokens_per_s"] == by["dp-torch"]["predicted_tokens_per_s"]
    assert by["dp"]["predicted_tokens_per_s"] > by["single"]["predicted_tokens_per_s"]
    assert by["pp-interleaved"]["predicted_breakdown_s"]["bubble"] < by["pp-1f1b"]["predicted_breakdown_s"]["bubble"]
    text = md.read_text()
    assert "Spearman rank correlation" in text and "| zero3 | 2 | dp2 tp1 pp1 z3 none mb8 |" in text
    assert f"{out['spearman']:.3f}" in capsys.readouterr().out
    assert vp.main(argv[:4] + ["--config", str(root / "configs" / "tiny.toml"), "--peak-flops", "1e11"]) == 2
    assert "does not match the bench run" in capsys.readouterr().err
