"""`zerotron plan`: layout enumeration invariants, cost-model hand checks, ranking sanity,
calibration, JSON schema and errors. Pure arithmetic (no processes)."""

import json
from dataclasses import replace

import pytest

from zerotron.analysis.comm_messages import comm_bytes
from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.flops import gpt_num_params, shape_of
from zerotron.analysis.hardware import OPS, calibrate, custom_hardware, fit_alpha_beta, hardware
from zerotron.analysis.layout_cost import evaluate
from zerotron.analysis.memory import GB, model_state_bytes, parse_memory, stage_num_params
from zerotron.analysis.plan_cli import plan_main
from zerotron.analysis.planner import plan
from zerotron.models.gpt import preset_config
from zerotron.parallel.pipeline.simulation import bubble_theory

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
        assert r["dp"] * r.get("cp", 1) * r["tp"] * r["pp"] == gpus
        assert r.get("cp", 1) == 1 or seq % (2 * r["cp"]) == 0
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


def test_gpu_count_no_mesh_can_split_is_refused_with_counts_that_can():
    """100,000 GPUs for GPT-2 and a global batch of 256: no dp x tp x pp x cp split passes the
    divisibility and layer rules (100,000 = 2^5 5^5; dp | 256, tp | 12, pp <= 12, cp | 512), so no
    layout exists at any memory size; the planner said "no layout fits: add GPUs or memory". Now a
    ValueError (the CLI's one line, exit 2) names the nearest counts that split (each checked here
    to have a mesh that passes); far beyond the largest usable count, that count."""
    import re

    from zerotron.analysis.planner import split_refusal

    cfg, cm = preset_config("gpt2"), CostModel(hardware("h100"), 8)
    with pytest.raises(ValueError, match="no split of 100,000 GPUs") as e:
        plan(cfg, 100000, 80 * GB, 256, 1024, cm)
    counts = [int(g) for g in re.findall(r"--gpus (\d+)", str(e.value))]
    assert len(counts) == 2 and counts[0] < 100000 < counts[1] and all(g % 8 == 0 for g in counts), str(e.value)
    for g in counts:
        assert split_refusal(shape_of(cfg), g, 256, 1024, cm) is None
    most = 256 * 12 * 12 * 512  # dp x largest tp x n_layer x largest cp
    msg = split_refusal(shape_of(cfg), 8 * most, 256, 1024, cm)
    assert f"at most {most:,} GPUs can be used; pass --gpus {most}," in msg, msg
    assert split_refusal(shape_of(cfg), 64, 256, 1024, cm) is None  # an ordinary count


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


def _no_latency(hw, **kw):
    return replace(hw, latency_intra=dict.fromkeys(OPS, 0.0), latency_inter=dict.fromkeys(OPS, 0.0), **kw)


def test_cost_model_hand_computed():
    cfg = preset_config("gpt2")
    h, L, V, S = 768, 12, 50257, 1024
    hw = _no_latency(hardware("h100"))  # 989e12 FLOP/s, 450e9 x 0.8 = 360e9 B/s NVLink
    vr = 3.35e12 / 4  # element passes/s: HBM bytes/s over one bf16 read + write
    assert hw.vector_rate == vr
    cm = CostModel(hw, compute_eff=0.5, launch_s=0.0)
    # pure dp = 2, ZeRO 0: compute of m = 4 micro-batches of 2 sequences, then one all-reduce of the
    # gradients in reduce_dtype "auto" = the parameter dtype: fp32 under bf16 (4 bytes per element)
    r = evaluate(cfg, dict(dp=2, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=2,
                           recompute="none"), S, 16, cm)
    flops = 8 * S * (L * (72 * h * h + 12 * h * S) + 6 * h * V)
    vec = 8 * S * (L * 14 * h + 2 * V)  # LN 4h + GELU 8h + residual 2h per layer; softmax 2V
    psi = gpt_num_params(L, 12, h, V, 1024)
    t_dp = 4 * psi * (2 * (2 - 1) / 2) / 360e9
    assert r["time_breakdown_s"]["vector"] == pytest.approx(vec / vr, rel=1e-12)
    assert r["predicted_step_time_s"] == pytest.approx(flops / (989e12 * 0.5) + vec / vr + t_dp,
                                                       rel=1e-12)
    assert r["predicted_mfu"] == pytest.approx(
        (6 * psi + 12 * L * h * S) * 16 * S / (r["predicted_step_time_s"] * 2 * 989e12))
    # tp = 2, ZeRO-0 under bf16 (fp32 parameters: an fp32 residual stream): per micro-batch and
    # layer 2 forward all-reduces of b*S*h bf16 row outputs and 2 backward ones of the fp32 column
    # input gradients (GPT-2: c_attn, c_fc), the embedding's forward and the head's backward one
    # (fp32), 3 b*S fp32 (vocab-parallel loss); factor 2(t-1)/t = 1. GELU and the softmax split over tp.
    r2 = evaluate(cfg, dict(dp=1, tp=2, pp=1, zero_stage=0, schedule="none", micro_batch=2,
                            recompute="none"), S, 16, cm)
    b2 = r2["time_breakdown_s"]
    assert b2["tp_comm"] == pytest.approx(8 * ((2 * L * 2 + 2 * L * 4 + 2 * 4) * 2 * S * h + 3 * 2 * S * 4) / 360e9)
    assert b2["vector"] == pytest.approx(16 * S * (L * (6 * h + 4 * h) + V) / vr)
    # the recomputed forward re-runs attention's row-parallel all-reduce, not the MLP's (torch's
    # checkpoint stops once the saved tensors are back): 3 bf16 forward ones per layer, not 2
    r2f = evaluate(cfg, dict(r2, recompute="full"), S, 16, cm)
    assert r2f["time_breakdown_s"]["tp_comm"] == pytest.approx(
        8 * ((3 * L * 2 + 2 * L * 4 + 2 * 4) * 2 * S * h + 3 * 2 * S * 4) / 360e9)
    sp = evaluate(cfg, dict(r2), S, 16, CostModel(hw, compute_eff=0.5, launch_s=0.0, sp=True))
    assert sp["sp"] and sp["time_breakdown_s"]["vector"] == pytest.approx(16 * S * L * 7 * h / vr
                                                                          + 16 * S * V / vr)
    # pp = 4, 1F1B, m = 8: the slowest stage (the last: output layer) runs 8 micro-batches, the
    # fill and drain pass once through each other stage
    r4 = evaluate(cfg, dict(dp=1, tp=1, pp=4, zero_stage=0, schedule="1f1b", micro_batch=2,
                            recompute="none"), S, 16, cm)
    b, st = r4["time_breakdown_s"], r4["stage_time_s"]
    busy = b["compute"] + b["vector"] + b["pp_comm"] + b["tp_comm"] + b["overhead"]
    assert busy == pytest.approx(8 * st[3]) and st[3] == max(st) and st[0] == pytest.approx(st[1])
    assert b["bubble"] == pytest.approx(st[0] + st[1] + st[2])
    # interleaved (v = 2) halves that bubble
    ri = evaluate(cfg, dict(dp=1, tp=1, pp=4, zero_stage=0, schedule="interleaved", micro_batch=2,
                            recompute="none"), S, 16, cm)
    assert ri["time_breakdown_s"]["bubble"] == pytest.approx((sum(ri["stage_time_s"]) - max(ri["stage_time_s"])) / 2)
    # equal stages (a 8-word vocabulary: no output-layer imbalance): Narayanan et al.'s fraction
    small = preset_config("gpt2", vocab_size=8)
    for kind, v in (("1f1b", 1), ("interleaved", 2)):
        re = evaluate(small, dict(dp=1, tp=1, pp=4, zero_stage=0, schedule=kind, micro_batch=2,
                                  recompute="none"), S, 16, cm)
        assert re["time_breakdown_s"]["bubble"] / re["predicted_step_time_s"] == pytest.approx(
            bubble_theory(4, 8, v), rel=1e-3)
    # full recompute adds one forward of the layers but the MLP's down projection (4h x h; torch's
    # checkpoint stops early, tests/test_dryrun.py counts it): 2 (12 - 4) h^2 + 4hS
    rf = evaluate(cfg, dict(dp=2, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=2,
                            recompute="full"), S, 16, cm)
    extra = 8 * S * L * (16 * h * h + 4 * h * S) / (989e12 * 0.5)
    assert rf["time_breakdown_s"]["compute"] == pytest.approx(r["time_breakdown_s"]["compute"]
                                                              + extra)
    assert rf["time_breakdown_s"]["vector"] == pytest.approx(vec / vr + 8 * S * L * 8 * h / vr)
    # ZeRO-3 per micro-batch (here m = 4) a reduce-scatter of the fp32 gradients and two all-gathers
    # of the bf16 blocks; native ZeRO-3 gathers the root unit (embeddings, final norm) once per step,
    # FSDP2 2m times (factor (n-1)/n = 1/2 each; the same bytes as comm_messages.comm_bytes)
    r3 = evaluate(cfg, dict(dp=2, tp=1, pp=1, zero_stage=3, schedule="none", micro_batch=2,
                            recompute="none"), S, 16, cm)
    root = psi - L * (12 * h * h + 13 * h)
    gathers = 2 * (8 * psi - 7 * root)
    assert r3["time_breakdown_s"]["dp_comm"] == pytest.approx((4 * 4 * psi + gathers) / 2 / 360e9)
    f3 = evaluate(cfg, dict(r3, zero_impl="fsdp2"), S, 16, cm)
    assert f3["time_breakdown_s"]["dp_comm"] == pytest.approx((4 * 4 * psi + 2 * 8 * psi) / 2 / 360e9)
    assert r3["time_breakdown_s"]["dp_comm"] * 2 * 360e9 == pytest.approx(
        comm_bytes(shape_of(cfg), dict(r3), S, 16, elem_bytes=2, reduce_bytes=4)["dp"])
    # overlap: half of the dp communication hides (the backward is far longer here)
    ro = evaluate(cfg, dict(r3), S, 16, CostModel(replace(hw, overlap=0.5), compute_eff=0.5, launch_s=0.0))
    assert ro["time_breakdown_s"]["dp_comm"] == pytest.approx(0.5 * r3["time_breakdown_s"]["dp_comm"])


def test_collective_latency_counts():
    """With alpha = 1 ms per call and near-infinite bandwidth, every comm term counts its calls."""
    cfg = preset_config("gpt2")
    L, alpha = 12, 1e-3
    hw = custom_hardware("x", 1e15, 10**12, 1e30, vector_rate=1e15, latency=alpha)
    cm = CostModel(hw, launch_s=0.0)
    base = dict(dp=1, tp=1, pp=1, zero_stage=0, schedule="none", micro_batch=2, recompute="none")
    bd = evaluate(cfg, dict(base, tp=2), 1024, 16, cm)["time_breakdown_s"]  # m = 8
    # per micro-batch 4 per layer, the embedding's, the head's input gradient's and the loss's 2
    assert bd["tp_comm"] == pytest.approx(8 * (4 * L + 1 + 1 + 2) * alpha)
    bd = evaluate(cfg, dict(base, tp=2), 1024, 16, replace(cm, sp=True))["time_breakdown_s"]
    assert bd["tp_comm"] == pytest.approx(8 * (2 * (4 * L + 1 + 1) + 2) * alpha)  # AG + RS pairs
    bd = evaluate(cfg, dict(base, pp=2, schedule="1f1b"), 1024, 16, cm)["time_breakdown_s"]
    assert bd["pp_comm"] == pytest.approx(8 * 2 * alpha)
    slow = CostModel(replace(hw, sync_penalty=alpha), launch_s=0.0)  # each call pays it on top
    bd = evaluate(cfg, dict(base, pp=2, schedule="1f1b"), 1024, 16, slow)["time_breakdown_s"]
    assert bd["pp_comm"] == pytest.approx(8 * 2 * 2 * alpha)
    # dp: one collective per flat buffer, U = 2L + 1 per sweep (each GPT-2 block: its decayed matrices
    # and its biases/norms; the root: embeddings and final norm, none decayed); ZeRO-0: ceil(bytes /
    # bucket) all-reduces of the fp32 gradients; ZeRO-3 (m = 4): per micro-batch a reduce-scatter
    # sweep and two all-gathers of every block's flats, the root gathered once per step
    psi = gpt_num_params(L, 12, 768, 50257, 1024)
    U = 2 * L + 1
    for z, calls in ((0, -(-4 * psi // (25 << 20))), (1, 2 * U), (2, 4 * U + U), (3, 4 * U + 2 * 4 * 2 * L + 1)):
        bd = evaluate(cfg, dict(base, dp=2, zero_stage=z), 1024, 16, cm)["time_breakdown_s"]
        assert bd["dp_comm"] == pytest.approx(calls * alpha), z


def test_alpha_beta_fit_recovers_known_link():
    alpha, bw = 2e-4, 3e9
    pts = [(x, alpha + x / bw) for x in (4096, 65536, 1 << 20, 1 << 24)]
    a, b = fit_alpha_beta(pts)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(bw, rel=1e-9)
    assert fit_alpha_beta([(1 << 20, 1e-3)]) == (0.0, pytest.approx((1 << 20) / 1e-3))
    a, _ = fit_alpha_beta([(1000, 1e-6), (2000, 2.5e-6)])  # would need alpha < 0: clipped, refit
    assert a == 0.0
    for bad in ([], [(0, 1.0)], [(10, 1.0), (20, 0.5)]):
        with pytest.raises(ValueError):
            fit_alpha_beta(bad)


def test_inter_node_links_used_when_groups_cross_nodes():
    cfg = preset_config("gpt2")
    hw = _no_latency(hardware("h100"))
    cm = CostModel(hw, gpus_per_node=2, launch_s=0.0)
    lay = dict(dp=1, tp=4, pp=1, zero_stage=0, schedule="none", micro_batch=1, recompute="none")
    cross = evaluate(cfg, lay, 1024, 4, cm)["time_breakdown_s"]["tp_comm"]
    inside = evaluate(cfg, lay, 1024, 4, CostModel(hw, gpus_per_node=4,
                                                   launch_s=0.0))["time_breakdown_s"]["tp_comm"]
    assert cross == pytest.approx(inside * 360 / 40)  # 50 GB/s NIC vs 450 GB/s NVLink, x 0.8
    # dp ranks sit tp apart (rank order pp, dp, tp): dp=2 x tp=2 fits a 4-GPU node, not a 2-GPU one
    lay = dict(dp=2, tp=2, pp=1, zero_stage=0, schedule="none", micro_batch=1, recompute="none")
    dp_t = [evaluate(cfg, lay, 1024, 4, CostModel(hw, gpus_per_node=k))
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
                               "--global-batch", "64", "--seq", "1024", "--top", "100000"])
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
    # all_reduce: two blocking sizes -> alpha-beta through both points (busbw = algbw on 2 ranks)
    gamma = (1e-2 - 1e-4) / ((1 << 24) - 4096)
    assert hw.intra["all_reduce"] == pytest.approx(1 / gamma)
    assert hw.latency_intra["all_reduce"] == pytest.approx(1e-4 - 4096 * gamma)
    # all_gather: one size -> its busbw, the datasheet latency kept; p2p not measured: datasheet
    assert hw.intra["all_gather"] == 3.0e9 and hw.latency_intra["all_gather"] == 10e-6
    # p2p is not in the file: it takes the all-reduce's fit; the inter-node link stays datasheet
    assert hw.intra["p2p"] == hw.intra["all_reduce"] and hw.latency_intra["p2p"] == hw.latency_intra["all_reduce"]
    assert hw.inter == hardware("h100").inter
    assert hw.overlap == 0.0 and calibrate(hardware("h100"), {**bench, "overlap": {"hidden_fraction": 0.7}}).overlap == 0.7
    # after_compute all-reduces: the sync penalty is the median extra time over the blocking ones
    assert hw.sync_penalty == 0.0
    after = [{"op": "all_reduce", "bytes": b, "time_s": t, "algbw_GBps": 1.0, "busbw_GBps": 1.0,
              "mode": "after_compute"} for b, t in ((4096, 3e-4), (1 << 24, 1.5e-2))]
    hs = calibrate(hardware("h100"), {**bench, "results": bench["results"] + after})
    assert hs.sync_penalty == pytest.approx((2e-4 + 5e-3) / 2)
    assert hs.intra["all_reduce"] == hw.intra["all_reduce"]  # after_compute rows are not fitted
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    argv = ["--model", "gpt2", "--gpus", "8", "--global-batch", "64", "--seq", "1024"]
    _, base = _json(capsys, argv)
    assert plan_main(argv + ["--json", "--calibrate", str(path)]) == 0
    out, err = capsys.readouterr()
    cal = json.loads(out)
    # a gloo (CPU) calibration against GPU targets: one warning line naming the fix
    assert len(err.strip().splitlines()) == 1 and "warning: the calibration file was measured with gloo" in err
    assert "'zerotron bench comm --backend nccl'" in err
    path.write_text(json.dumps({**bench, "topology": {"backend": "nccl", "device_type": "cuda"}}))
    assert plan_main(argv + ["--json", "--calibrate", str(path)]) == 0 and capsys.readouterr().err == ""
    assert cal["assumptions"]["intra_node_busbw_GBps"]["all_reduce"] == pytest.approx(gamma ** -1 / 1e9)
    assert base["assumptions"]["intra_node_busbw_GBps"]["all_reduce"] == 360.0
    assert cal["layouts"][0]["predicted_step_time_s"] > base["layouts"][0]["predicted_step_time_s"]
    with pytest.raises(ValueError, match="no busbw"):
        calibrate(hardware("h100"), {"results": []})


def test_custom_hardware_and_fp32_communication():
    """A measured CPU profile: custom peak, one busbw for every op (then calibrated); elem_bytes = 4
    (fp32 training) doubles every communication term and leaves compute alone (over ZeRO >= 1's
    bf16 parameters: ZeRO-0's bf16 training keeps an fp32 residual stream, comm_messages.stream_bytes)."""
    hw = custom_hardware("cpu", 5e10, 24 * 2**30, 1e9)
    assert (hw.name, hw.peak_flops, hw.memory) == ("cpu", 5e10, 24 * 2**30)
    assert hw.intra == hw.inter == {op: 1e9 for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    cal = calibrate(hw, {"results": [{"op": "p2p", "bytes": 1 << 22, "busbw_GBps": 1.5}]})
    assert cal.intra["p2p"] == 1.5e9 and cal.intra["all_reduce"] == 1e9 and cal.inter == hw.inter
    for bad in ((0, 1, 1), (1, 0, 1), (1, 1, -1)):
        with pytest.raises(ValueError, match="must be > 0"):
            custom_hardware("cpu", *bad)
    cfg = preset_config("gpt2")
    for lay in (dict(dp=2, tp=1, pp=1, zero_stage=3), dict(dp=1, tp=2, pp=1, zero_stage=1),
                dict(dp=1, tp=1, pp=2, zero_stage=1)):
        lay.update(schedule="1f1b" if lay["pp"] > 1 else "none", micro_batch=2, recompute="none")
        b2, b4 = (evaluate(cfg, lay, 256, 8, CostModel(cal, gpus_per_node=2, elem_bytes=e, reduce_bytes=e))
                  ["time_breakdown_s"] for e in (2, 4))
        assert b4["compute"] == b2["compute"]
        loss = 4 * 3 * 2 * 256 * 4 / 1e9 if lay["tp"] > 1 else 0.0  # fp32 loss statistics, m = 4
        for k in ("dp_comm", "tp_comm", "pp_comm"):
            assert b4[k] == pytest.approx(2 * b2[k] - (loss if k == "tp_comm" else 0.0))
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
    assert set(out["dropped"]) >= {"memory", "divisibility"}
    assert out["assumptions"]["global_batch"] == 8 and out["assumptions"]["seq"] == 64
    # supported_only keeps pipeline x ZeRO-2/3 (it runs) and drops nothing the planner proposes; a
    # layout config validation refuses (pipeline x HSDP) is flagged by the same rule
    from zerotron.analysis.planner import _refused
    from zerotron.config import ConfigError
    from zerotron.plan import build_plan
    from zerotron.testing import tiny_config

    cfg = preset_config("gpt2")
    every, ok = (plan(cfg, 16, 10**15, 16, 1024, CostModel(hardware("h100"), gpus_per_node=8), only)
                 for only in (False, True))
    assert ok["dropped"]["unsupported"] == 0 and ok["layouts"] == every["layouts"]
    assert any(r["pp"] > 1 and r["zero_stage"] > 1 for r in ok["layouts"])
    assert any(r.get("dp_replicate", 1) > 1 for r in ok["layouts"])
    four = plan(cfg, 16, 10**15, 16, 1024, CostModel(hardware("h100"), gpus_per_node=4), True)["layouts"]
    assert any(r["pp"] == 2 and r["dp"] * r["tp"] == 8 and r.get("dp_replicate") == 2 for r in four)  # pp x HSDP
    for pp, rep in ((2, 1), (1, 2), (2, 2)):
        c = tiny_config({"parallel.pp": pp, "parallel.dp": 4 // pp, "parallel.dp_replicate": rep,
                         "parallel.zero_stage": 3, "train.micro_batch": 1})
        try:
            build_plan(c, 4)
            accepted = True
        except ConfigError:
            accepted = False
        assert accepted == (not _refused(pp, rep)) or (4 // pp) % rep, (pp, rep)


@pytest.mark.parametrize("argv, word", [
    (["--model", "nope", "--gpus", "8", "--global-batch", "8"], "nope"),
    (["--model", "gpt2", "--gpus", "12", "--gpus-per-node", "8", "--global-batch", "8"], "multiple"),
    # 3 GPUs against the default 8 per node: the fix names the flag (was "gpus (3) must be a multiple of gpus_per_node (8)")
    (["--model", "gpt2", "--gpus", "3", "--global-batch", "8"], "on one node of 3 GPUs pass --gpus-per-node 3"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--top", "0"], "--top must be >= 1 (layouts to print), got 0"),
    (["--model", "gpt2", "--gpus", "8", "--gpu-mem", "80XB", "--global-batch", "8"], "memory"),
    (["--model", "gpt2", "--gpus", "8", "--gpu-mem", "lots", "--global-batch", "8"], "memory"),
    (["--model", "gpt2", "--gpus", "8"], "global-batch"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", str(10**23)], "--global-batch must be in [1, 2**63)"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--seq", "4096"], "block_size"),
    (["--model", "gpt2", "--gpus", "8", "--global-batch", "8", "--calibrate", "/no/such.json"],
     "cannot read calibration file '/no/such.json' (No such file or directory); pass the --json file of 'zerotron bench comm'"),
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
    hostile = []
    for i, content in enumerate(([1, 2], {"results": "x"}, {"results": [{"op": "all_reduce", "busbw_GBps": "abc"}]},
                                 {"results": [{"op": "p2p", "busbw_GBps": float("nan")}]})):
        hostile.append(tmp_path / f"hostile{i}.json")
        hostile[-1].write_text(json.dumps(content))
    for f in (bad, empty, *hostile):
        assert plan_main(["--model", "gpt2", "--gpus", "8", "--global-batch", "8",
                          "--calibrate", str(f)]) == 2
        assert "calibration" in capsys.readouterr().err
    # usable rows survive junk beside them: NaN overlap ignored, decreasing times keep the busbw
    mixed = {"results": [{"op": "all_reduce", "bytes": 4096, "time_s": 1e-3, "busbw_GBps": 1.0, "algbw_GBps": 1.0},
                         {"op": "all_reduce", "bytes": 8192, "time_s": 5e-4, "busbw_GBps": 2.0, "algbw_GBps": 2.0},
                         {"op": "all_gather", "bytes": "9", "time_s": None, "busbw_GBps": True}],
             "overlap": {"hidden_fraction": float("nan")}}
    hw = calibrate(hardware("h100"), mixed)
    assert hw.intra["all_reduce"] == 2.0e9 and hw.overlap == 0.0 and hw.intra["all_gather"] == 2.0e9


def test_parse_memory_and_stage_params():
    assert parse_memory("80GB") == 80 * GB and parse_memory("80 GiB") == 80 * 2**30
    assert parse_memory("1.5TB") == 1_500_000_000_000
    assert parse_memory("512KB") == 512_000 and parse_memory("1KiB") == 1024
    for bad in ("80", "80XB", "-1GB", "0GB", "", "0.5B"):
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
    # the planner prices neither the zero-bubble schedules, threads, torch's pipelining backend, cp, MoE nor
    # optimizer offload (the host link) yet
    unpriced = ({"pp-zb-h1", "pp-zb-v", "pp-threads-gpipe"} | {n for n in bt.LAYOUTS if n.startswith("pp-torch-")}
                | {n for n in bt.LAYOUTS if "cp-" in n} | {n for n in bt.LAYOUTS if n.startswith("moe-")}
                | {n for n in bt.LAYOUTS if n.endswith(("-offload", "-offdisk"))})
    for name in unpriced:
        assert name in bt.LAYOUTS and planner_layout(name, 2, 8) is None
    for name in set(bt.LAYOUTS) - unpriced:  # every other bench layout has a planner counterpart on 2 ranks
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
    # hostile inputs: one clear error, exit 2 (never a traceback)
    bench_rows = json.loads((root / "benchmarks" / "strategies_cpu.json").read_text())
    nan_rows = [dict(r, tokens_per_s=float("nan")) if r["layout"] == "zero1" else r for r in bench_rows]
    cases = [({"a": 1}, comm.read_text(), "not a 'zerotron bench train --json' file"),
             (["x"], comm.read_text(), "not a 'zerotron bench train --json' file"),
             ([{"layout": "dp", "skipped": False}], comm.read_text(), "field 'num_params' missing"),
             (bench_rows, "[1]", "not a 'zerotron bench comm --json' file"),
             (nan_rows, comm.read_text(), "'zero1': tokens_per_s must be a positive finite number"),
             ([dict(r, layout="bogus") for r in bench_rows], comm.read_text(), "planner counterpart"),
             ([dict(r, peak_mem_kind="cuda max_memory_allocated") for r in bench_rows], comm.read_text(),
              "validates CPU (gloo) bench train runs only")]
    for rows, comm_text, msg in cases:
        (tmp_path / "bt.json").write_text(json.dumps(rows))
        (tmp_path / "bc.json").write_text(comm_text)
        assert vp.main(["--bench-train", str(tmp_path / "bt.json"), "--bench-comm", str(tmp_path / "bc.json"),
                        "--peak-flops", "1e11"]) == 2
        assert msg in capsys.readouterr().err, msg


def test_hsdp_priced_on_two_links():
    """HSDP (dp_replicate R): states sharded by S = dp / R; ZeRO collectives over S on the intra-node
    link, one all-reduce of the 1/S shard across R on the inter-node link per unit and step; the
    planner offers it where the dp block spans nodes and prefers it there on slow NICs."""
    from zerotron.analysis.cost_model import dp_time, link_model
    from zerotron.analysis.hardware import collective_time

    cfg = preset_config("gpt2")
    hw = _no_latency(hardware("h100"))
    cm = CostModel(hw, gpus_per_node=8, launch_s=0.0)
    flat = dict(dp=16, tp=1, pp=1, zero_stage=3, schedule="none", micro_batch=4, recompute="none")
    hsdp = {**flat, "dp_replicate": 2}
    a, b = evaluate(cfg, flat, 1024, 64, cm), evaluate(cfg, hsdp, 1024, 64, cm)
    n = stage_num_params(cfg, 1, 1, 1)[0]
    assert b["memory_bytes_per_gpu"] - a["memory_bytes_per_gpu"] == (
        model_state_bytes(n, 8, 3, "bf16-mixed")["total_bytes"] - model_state_bytes(n, 16, 3, "bf16-mixed")["total_bytes"])
    assert b["time_breakdown_s"]["dp_comm"] < a["time_breakdown_s"]["dp_comm"] / 3  # NIC 9x slower than NVLink
    intra, inter = link_model(hw, True), link_model(hw, False)
    units, m = 2 * cfg.n_layer + 1, 64 // (16 * 4)  # flat buffers: 2 per block, 1 root
    root = n - cfg.n_layer * (12 * cfg.n_embd ** 2 + 13 * cfg.n_embd)  # embeddings + final norm
    g = 4.0 * n  # the gradients in fp32 (reduce_dtype "auto" under bf16)
    want = dp_time(3, m, units, n, 8, intra, cm, root=root) + collective_time(g / 8, "all_reduce", 2, *inter,
                                                                               calls=units)
    assert dp_time(3, m, units, n, 16, intra, cm, 2, inter, root) == pytest.approx(want)
    assert b["time_breakdown_s"]["dp_comm"] == pytest.approx(want)  # what evaluate charges (overlap 0)
    assert a["time_breakdown_s"]["dp_comm"] == pytest.approx(dp_time(3, m, units, n, 16, inter, cm, root=root))
    res = plan(cfg, 16, 80 * GB, 512, 1024, cm)["layouts"]
    assert res[0].get("dp_replicate") == 2 and res[0]["dp"] * res[0]["tp"] == 16
    assert not [r for r in plan(cfg, 8, 80 * GB, 64, 1024, cm)["layouts"] if r.get("dp_replicate")]  # one node


def test_bench_plan_keeps_the_inter_node_link_of_a_two_node_run():
    """``bench plan`` on a two-node harness run prices HSDP's replica all-reduce on the calibrated
    inter-node link (its ``bench comm`` inter results), and a one-node file stays one node."""
    from zerotron.bench.validate_plan import cpu_hardware

    res = [{"scope": s, "op": "all_reduce", "bytes": b, "busbw_GBps": bw, "mode": "blocking", "time_s": b / (bw * 1e9)}
           for s, bw in (("intra", 0.5), ("inter", 0.0125)) for b in (1 << 20, 1 << 22)]
    two = {"results": res, "topology": {"world_size": 4, "nodes": [{"node": 0}, {"node": 1}]}}
    hw, world, nodes = cpu_hardware(two, 1e10, 1 << 34, 1e9)
    assert (world, nodes) == (4, 2) and hw.inter["all_reduce"] < hw.intra["all_reduce"] / 10
    one = {"results": [r for r in res if r["scope"] == "intra"], "topology": {"world_size": 2}}
    hw1, _, n1 = cpu_hardware(one, 1e10, 1 << 34, 1e9)
    assert n1 == 1 and hw1.inter == hw1.intra


def test_context_parallel_priced():
    """cp (ring attention): a rank of dp 1 x cp 2 computes what a rank of dp 2 does (S/2 tokens of
    twice the micro-batches, each query against all S keys); memory = states over dp x cp +
    activations at S/cp; the ring's exposed transfer on a machine where attention takes no time
    is L x (alpha per message + bytes / busbw) of ``ring_messages``; the data-parallel reduction
    runs over dp x cp; and for long sequences the planner proposes cp."""
    from zerotron.analysis.activations import activation_bytes
    from zerotron.analysis.comm_messages import ring_messages
    from zerotron.analysis.flops import shape_of

    cfg = preset_config("gpt2")
    S, L, h = 1024, cfg.n_layer, cfg.n_embd
    hw = custom_hardware("t", peak_flops=1e15, memory=10**12, busbw=1e9, vector_rate=1e12, latency=1e-5)
    cm = CostModel(hw, gpus_per_node=8, compute_eff=1.0, overhead=0, launch_s=0.0)
    base = dict(tp=1, pp=1, zero_stage=1, schedule="none", micro_batch=2, recompute="none")
    dp2 = evaluate(cfg, dict(base, dp=2), S, 16, cm)
    cp2 = evaluate(cfg, dict(base, dp=1, cp=2), S, 16, cm)
    assert cp2["time_breakdown_s"]["compute"] == pytest.approx(dp2["time_breakdown_s"]["compute"], rel=1e-12)
    assert cp2["microbatches"] == 2 * dp2["microbatches"]
    shape = shape_of(cfg)
    act = activation_bytes(shape, 2, S // 2, tp=1, sp=False, pp=1, schedule="1f1b", microbatches=8,
                           virtual_stages=1, recompute="none", dtype="bf16", attention="flash")["per_rank_bytes"][0]
    states = model_state_bytes(stage_num_params(shape, 1, 1, 1, [L])[0], 2, 1, "bf16-mixed", "adam")["total_bytes"]
    assert cp2["memory_bytes_per_gpu"] == states + act
    r = ring_messages(shape, 2, S, 2, "none", 2)
    assert (r["kv"], r["dkv"], r["kv_bytes"]) == (2, 2, 2 * 2 * (S // 2) * h * 2) and r["dkv_bytes"] == 2 * r["kv_bytes"]
    msgs, nbytes = r["kv"] + r["dkv"], r["kv"] * r["kv_bytes"] + r["dkv"] * r["dkv_bytes"]
    attn = 2 * S / 2 * 12 * h * S / 1e15  # the attention the transfer hides behind, per layer
    assert cp2["time_breakdown_s"]["cp_comm"] == pytest.approx(8 * L * (msgs * 1e-5 + nbytes / 1e9 - attn), rel=1e-9)
    # ZeRO-1 over dp x cp = 2 ranks: the same reduce-scatter + all-gather as dp 2
    assert cp2["time_breakdown_s"]["dp_comm"] == pytest.approx(dp2["time_breakdown_s"]["dp_comm"], rel=1e-12)
    # Llama-3-8B at 64K tokens on 8 H100: only context parallelism fits without deep recomputation
    from zerotron.models.registry import preset_config as any_preset

    llama = any_preset("llama3-8b", block_size=65536)
    best = plan(llama, 8, 80 * GB, 8, 65536, CostModel(hardware("h100"), 8))["layouts"][0]
    assert best.get("cp", 1) > 1, best


def test_moe_plan_searches_expert_parallelism():
    """Mixture-of-experts: ``plan`` searches ep (dividing n_experts and dp x cp). Mixtral-8x7B
    (46.7B parameters, 747 GB of bf16-mixed Adam states) fits no layout on 8 x 80 GB at all; on
    16 x 80 GB without a pipeline, ZeRO-1/2 fit only with ep > 1 (E/ep experts' parameters and
    gradients per rank) and the fastest such layout takes ep 8 (one node: the all-to-all on
    NVLink). The memory of an ep layout is the dense states over dp plus the local experts'
    states over dp/ep; the all-to-all is priced (``ep_comm``) only when ep > 1."""
    from zerotron.models import registry

    cfg, cm = registry.preset_config("mixtral-8x7b"), CostModel(hardware("h100"))
    assert not plan(cfg, 8, 80 * GB, 64, 4096, cm)["layouts"]
    res = plan(cfg, 16, 80 * GB, 64, 4096, cm)["layouts"]
    flat = [r for r in res if r["pp"] == 1 and r.get("cp", 1) == 1]
    assert any(r["zero_stage"] < 3 for r in flat) and all(r.get("ep", 1) > 1 for r in flat if r["zero_stage"] < 3)
    assert flat[0].get("ep") == 8, flat[0]
    lay = dict(dp=16, tp=1, pp=1, zero_stage=1, schedule="none", micro_batch=1, recompute="full")
    e1, e8 = evaluate(cfg, lay, 4096, 64, cm), evaluate(cfg, {**lay, "ep": 8}, 4096, 64, cm)
    total, s = sum(stage_num_params(cfg, 1, 1)), cfg
    experts = s.n_layer * s.n_experts * 3 * s.n_embd * s.intermediate_size
    msb = lambda n, dp: model_state_bytes(n, dp, 1, "bf16-mixed", "adam")["total_bytes"]  # noqa: E731
    assert e8["memory_bytes_per_gpu"] - e1["memory_bytes_per_gpu"] == msb(experts // 8, 2) - msb(experts, 16)
    assert e1["memory_bytes_per_gpu"] > 80 * GB >= e8["memory_bytes_per_gpu"]
    assert e1["time_breakdown_s"]["ep_comm"] == 0 < e8["time_breakdown_s"]["ep_comm"]
    assert e8["moe"]["state_bytes"] == [msb(total - experts, 16) + msb(experts // 8, 2)]
    with pytest.raises(ValueError, match="ep"):
        evaluate(cfg, {**lay, "ep": 3}, 4096, 64, cm)


def test_moe_plan_ep_with_cp_and_pp_is_what_training_accepts(capsys):
    """The planner's ep x cp (ep carved out of dp x cp) and ep x pp layouts of the mixtral-tiny preset
    (8 experts, 4 layers, 4 / 2 heads: the shape of ``configs/moe_tiny.toml``) on 8 GPUs: every
    layout it proposes (each distinct parallel shape) is one the plan (``build_plan``, the
    training's validation, on ``configs/moe_tiny.toml``) accepts; it proposes ep over cp alone (dp 1 x cp 2 =
    ep 2) and ep under a pipeline; no ep layout the plan would refuse is missing (every ep dividing
    n_experts and dp x cp is priced for some layout of each mesh); and the model states and all-to-all
    bytes it prices per pipeline rank equal ``zerotron memory --ep --json`` for the same layout."""
    from zerotron.analysis.memory_cli import memory_main
    from zerotron.config import ConfigError
    from zerotron.models import registry
    from zerotron.plan import build_plan
    from zerotron.testing import tiny_config

    cfg = registry.preset_config("mixtral-tiny")
    res = plan(cfg, 8, 10**15, 16, 64, CostModel(hardware("h100"), gpus_per_node=8, backend="gloo", sp=True))
    lays = res["layouts"]
    ep_cp = [r for r in lays if r.get("ep", 1) > 1 and r.get("cp", 1) > 1]
    assert any(r["dp"] == 1 and r["ep"] == r["cp"] for r in ep_cp), "ep over the cp ranks alone"
    assert any(r.get("ep", 1) > 1 and r["pp"] > 1 for r in lays) and any(r.get("ep", 1) > r["dp"] for r in ep_cp)
    shapes = {}
    for r in lays:
        key = (r["dp"], r["tp"], r["pp"], r.get("cp", 1), r.get("ep", 1), r.get("dp_replicate", 1), r["zero_stage"],
               r["schedule"], r["micro_batch"])
        shapes.setdefault(key, r)
    for (dp, tp, pp, cp, ep, rep, z, kind, b), r in shapes.items():
        over = {"parallel.dp": dp, "parallel.tp": tp, "parallel.pp": pp, "parallel.cp": cp, "parallel.ep": ep,
                "parallel.dp_replicate": rep, "parallel.zero_stage": z, "parallel.sequence_parallel": str(tp > 1).lower(),
                "train.micro_batch": b, "train.global_batch": 16, "train.activation_checkpointing": r["recompute"]}
        if pp > 1:
            over.update({"parallel.pp_schedule": kind, "parallel.virtual_stages": r["virtual_stages"]})
        try:
            build_plan(tiny_config(over, "configs/moe_tiny.toml"), 8)
        except ConfigError as e:
            raise AssertionError(f"the planner proposes a layout the plan refuses: {over}: {e}") from None
    priced = {(k[0], k[1], k[2], k[3], k[5]): set() for k in shapes}
    for k in shapes:
        priced[k[0], k[1], k[2], k[3], k[5]].add(k[4])
    for (dp, tp, pp, cp, rep), eps in priced.items():
        want = {e for e in (1, 2, 4, 8) if (dp // rep * cp) % e == 0 and not (pp > 1 and rep > 1 and e > 1)}
        assert eps == want, ((dp, tp, pp, cp, rep), eps, want)
    # the bytes: what zerotron memory --ep prints for the same layout (one per (pp, cp, ep, tp, zero))
    seen = set()
    for r in lays:
        if r.get("ep", 1) == 1 or (r["pp"], r.get("cp", 1), r["ep"], r["tp"], r["zero_stage"]) in seen:
            continue
        seen.add((r["pp"], r.get("cp", 1), r["ep"], r["tp"], r["zero_stage"]))
        argv = ["--model", "mixtral-tiny", "--dp", str(r["dp"]), "--ep", str(r["ep"]), "--cp", str(r.get("cp", 1)),
                "--dp-replicate", str(r.get("dp_replicate", 1)),
                "--tp", str(r["tp"]), "--pp", str(r["pp"]), "--seq", "64", "--micro-batch", str(r["micro_batch"]),
                "--global-batch", "16", "--dtype", "bf16-mixed", "--recompute", r["recompute"]]
        argv += ["--sp"] if r["tp"] > 1 else []
        argv += ["--schedule", r["schedule"]] if r["pp"] > 1 else []
        assert memory_main(argv + ["--json"]) == 0
        ranks = json.loads(capsys.readouterr().out)["moe"]["pipeline_ranks"]
        assert [x["states"][r["zero_stage"]]["total_bytes"] for x in ranks] == r["moe"]["state_bytes"], r
        assert [x["all_to_all_bytes"] for x in ranks] == r["moe"]["all_to_all_bytes"] and min(
            r["moe"]["all_to_all_bytes"]) > 0, r
    assert len(seen) >= 20, len(seen)
    # by hand: dp 1 x cp 2 = ep 2 x pp 2 (2 layers per rank), tp 2 + SP, 4 micro-batches of 2 x 64 tokens,
    # each rank routing 64 / 2 / 2 of each sequence; full recomputation: 6 exchanges and the counts twice
    lay = dict(dp=1, cp=2, ep=2, tp=2, pp=2, zero_stage=1, schedule="1f1b", micro_batch=2, recompute="full")
    one = evaluate(cfg, lay, 64, 8, CostModel(hardware("h100"), gpus_per_node=8, sp=True))["moe"]
    assert one["all_to_all_bytes"] == [2 * 4 * (6 * 2 * 16 * 2 * 64 * 2 + 2 * 8 * 8)] * 2, one
