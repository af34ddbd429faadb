"""``zerotron dryrun`` (zerotron.analysis.dryrun): one step of a rank of a layout traced in this
process with fake tensors and the fake process group.

* Against real runs (4 gloo processes, one spawn for all layouts): per traced rank, the collective
  bytes and calls per (op, group, tag) of the measured step equal ``comm.STATS`` of the real
  ``train.step.train_step``, and ``Strategy.model_state_bytes`` equals the real rank's.
* Against the estimators: model states exact up to ZeRO's flat-buffer padding (derived below), the
  tracker's labelled bytes at the end of the step equal the strategy's own count, and the traced
  peak lies between the estimate and a derived upper bound.
* The out-of-memory report and the CLI's one-line errors (exit 2).
"""
import json

import pytest
import torch

from zerotron.testing import run_ranks, tiny_config

WORLD = 4
BASE = {"train.micro_batch": 2, "train.global_batch": 8, "model.block_size": 32}
# (name, overrides): every synchroniser and runner family the dry run covers, on 4 ranks
LAYOUTS = [
    ("ddp-dp4", {"parallel.dp": 4}),
    ("zero1-dp2-pp2-1f1b", {"parallel.dp": 2, "parallel.pp": 2, "parallel.zero_stage": 1}),
    ("zero2-dp2-tp2", {"parallel.dp": 2, "parallel.tp": 2, "parallel.zero_stage": 2}),
    ("zero3-dp4", {"parallel.dp": 4, "parallel.zero_stage": 3}),
    ("ddp-tp2-pp2-sp", {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": "true"}),
    ("fsdp2-dp4", {"parallel.dp": 4, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}),
]


def _cfg(overrides):
    return tiny_config({**BASE, **overrides})


def _by_key(stats) -> dict:
    return {"/".join(k): (stats.calls[k], b) for k, b in stats.bytes.items()}


def _real_layouts(layouts):
    """Every rank: for each layout, the dry run's set-up with real tensors on gloo, two
    ``train_step``s, the second one's traffic per (op/group/tag) and the model-state bytes."""
    import torch.distributed as dist

    from zerotron.analysis.dryrun import build_rank, synthetic_batches
    from zerotron.distributed import comm
    from zerotron.distributed.mesh import Mesh
    from zerotron.parity.runs import destroy_subgroups
    from zerotron.plan import build_plan
    from zerotron.train.optim import build_scheduler
    from zerotron.train.step import train_step

    out = {}
    for name, ov in layouts:
        cfg = _cfg(ov)
        plan = build_plan(cfg, dist.get_world_size())
        mesh = Mesh(plan.dims, torch.device("cpu"))
        mcfg, strategy, optimizer = build_rank(cfg, plan, mesh)
        sched = build_scheduler(optimizer, cfg.train)
        n_micro = cfg.train.global_batch // (mesh.size("dp") * cfg.train.micro_batch)
        batches = synthetic_batches(n_micro, cfg.train.micro_batch, mcfg.block_size, mcfg.vocab_size, cfg.train.seed)
        for i in range(2):
            comm.STATS.reset()
            train_step(strategy, optimizer, sched, batches, mesh.group("batch"), cfg.train.grad_clip, cfg.train.dtype)
        out[name] = {"comm": _by_key(comm.STATS), "states": strategy.model_state_bytes(optimizer)}
        del strategy, optimizer
        destroy_subgroups()
    return out


@pytest.fixture(scope="module")
def real():
    return run_ranks(_real_layouts, WORLD, LAYOUTS, join_timeout_s=600)


@pytest.fixture(scope="module")
def dry():
    from zerotron.analysis.dryrun import default_ranks, dry_run
    from zerotron.distributed import comm
    from zerotron.plan import build_plan

    # the first and last pipeline stage (default_ranks) and the last rank (other dp/tp coordinates)
    out = {name: dry_run(_cfg(ov), WORLD, sorted({*default_ranks(build_plan(_cfg(ov), WORLD).dims), WORLD - 1}))
           for name, ov in LAYOUTS}
    comm.STATS.reset()
    return out


@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_traffic_and_model_states_equal_the_real_run(name, real, dry):
    for rec in dry[name]:
        rank = rec["rank"]
        got = {"{}/{}/{}".format(key.split("/", 1)[0], g, key.split("/", 1)[1]): (c["calls"], c["bytes"])
               for g, v in rec["comm_traced"].items() for key, c in v["ops"].items()}
        want = real[rank][name]["comm"]
        assert got == want, (name, rank, sorted(set(got.items()) ^ set(want.items())))
        assert rec["model_state_bytes"] == real[rank][name]["states"], (name, rank)


@pytest.mark.parametrize("name", [n for n, _ in LAYOUTS])
def test_estimates_bound_the_trace(name, dry):
    """Model states: the estimator shards ceil(Psi/N) once; the implementations pad each flat buffer
    (ZeRO: one per unit and decay group) or each tensor (FSDP2: dim 0 to a multiple of N) to a
    multiple of N, so per rank they may hold up to N - 1 elements more per padded buffer or tensor,
    for each of the P + G + K bytes per element -- the tolerance below. The fp32 ZeRO-2/3 gradient
    shard and ZeRO-1's extra fp32 shard gradient are not in the formula either (bf16 only).
    The tracker's labels at the end of the step equal the strategy's own count (its optimizer
    count leaves out AdamW's 0-dim ``step`` tensors: 4 bytes each, at most one per parameter).
    Peak: at least the estimate's model states + activations of one micro-batch's layers (the
    estimator is a lower bound: it leaves out the loss temporaries, the gathered ZeRO-3 units and
    the backward's transient gradients), and at most 3x the estimate at this tiny size (the
    (b, T, V) logits, their log-softmax and gradient dominate a 4-layer 64-wide model)."""
    n_layer = tiny_config().model.n_layer
    buffers = 2 * (n_layer + 2)  # ZeRO: a decay and a no-decay flat per block and per root unit
    for rec in dry[name]:
        est, ms = rec["estimated"], rec["model_state_bytes"]
        dp = rec["estimated"]["dp"]
        pad = 16 * (dp - 1) * buffers  # (P + G + K) = 4 + 4 + 8 bytes per fp32 element
        assert abs(ms["total_bytes"] - est["model_states"]["total_bytes"]) <= pad, (name, ms, est)
        end = rec["end_of_step"]
        assert end["parameters"] == ms["params_bytes"], (name, end, ms)
        assert end["gradients"] == ms["grads_bytes"], (name, end, ms)
        n_params = 16 * (n_layer + 1)  # an upper bound of the parameter tensors (GPT-2: 12 per block + 4)
        assert 0 <= end["optimizer"] - ms["optimizer_bytes"] <= 4 * n_params, (name, end, ms)
        assert est["model_states"]["total_bytes"] <= rec["peak_bytes_traced"] <= 3 * est["total"], (name, rec)
        assert rec["peak_at"]["phase"] in ("forward_backward", "finish_grads", "optimizer_step"), rec["peak_at"]


def test_planned_comm_bytes(dry):
    """The planner's per-group bytes (analysis.comm_messages.comm_bytes) against the trace, fp32: dp of
    ZeRO-0 equal (one all-reduce of the gradient buffers); pp: first and last stage move 2 m
    activations' worth (every group and layout, bf16: tests/test_dryrun_planbytes.py)."""
    rec = dry["ddp-dp4"][0]
    assert rec["comm_traced"]["dp"]["ops"]["all_reduce/grad"]["bytes"] == rec["comm_bytes_planned"]["dp"]
    for rec in dry["zero1-dp2-pp2-1f1b"]:
        p2p = sum(c["bytes"] for k, c in rec["comm_traced"]["pp"]["ops"].items() if k.split("/")[0] in ("send", "recv"))
        assert p2p == rec["comm_bytes_planned"]["pp"]


def test_out_of_memory_report():
    """A layout that cannot fit under --gpu-mem is reported out of memory, in the measured step,
    with the category that grew past the limit."""
    from zerotron.analysis.dryrun import dry_run

    cfg = _cfg({"parallel.dp": 4})
    free = dry_run(cfg, WORLD, ranks=[0], gpu_mem=10**9)[0]
    assert free["oom"] is None
    states, peak = free["end_of_step"]["total"], free["peak_bytes_traced"]
    rec = dry_run(cfg, WORLD, ranks=[0], gpu_mem=(states + peak) // 2)[0]  # the states fit, the step does not
    assert rec["oom"]["total_bytes"] > (states + peak) // 2
    assert rec["oom"]["phase"] == "forward_backward", rec["oom"]
    assert rec["oom"]["category"] in ("activations", "temporary"), rec["oom"]
    rec = dry_run(cfg, WORLD, ranks=[0], gpu_mem=states // 2)[0]  # not even the model states fit
    assert rec["oom_step"]["phase"] == "model states" and rec["oom_step"]["category"] == "optimizer", rec
    # the construction (train.meta_init: what the rank holds + one dense tensor) is reported first where it overflows
    build = rec["construction_bytes"] if rec["meta_init"] else rec["setup_peak_bytes"]
    assert rec["oom"]["phase"] == ("setup" if build > states // 2 else "model states"), rec


def test_cli(tmp_path, capsys):
    from zerotron.analysis.dryrun_cli import dryrun_main

    out = tmp_path / "new" / "d.json"  # a folder not made yet: created, as bench's --json does (was refused)
    args = ["--config", "configs/tiny.toml", "--world", "4", "--parallel.pp", "2", "--parallel.dp", "2",
            "--train.global_batch", "8", "--train.micro_batch", "2", "--json", str(out)]
    assert dryrun_main(args) == 0
    recs = json.loads(out.read_text())
    assert [r["rank"] for r in recs] == [0, 2]  # first and last pipeline stage
    for r in recs:
        assert {"rank", "coords", "peak_bytes_traced", "peak_bytes_estimated", "comm_bytes_traced",
                "comm_bytes_planned"} <= set(r)
    assert "peak" in capsys.readouterr().out
    assert dryrun_main(args + ["--gpu-mem", "1MB", "--rank", "0"]) == 1  # out of memory
    for bad, words in ((["--rank", "9"], "--rank 9"), (["--world", "3", "--parallel.dp", "2"], "world size 3"),
                       (["--parallel.bogus", "1"], "parallel.bogus")):
        argv = ["--config", "configs/tiny.toml", "--world", "4", "--train.micro_batch", "2"] + bad
        assert dryrun_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_cli_json_path_checked_before_the_trace(tmp_path, capsys, monkeypatch):
    """--json onto a directory, through a file or where nothing can be written: one line, exit 2, before any tracing
    (before: a traceback from open() after the whole trace, exit 1). (A missing folder is created: test_cli.)"""
    import zerotron.analysis.dryrun as dryrun
    from zerotron.analysis.dryrun_cli import dryrun_main

    def no_trace(*a, **k):
        raise AssertionError("traced before the --json path was checked")

    monkeypatch.setattr(dryrun, "dry_run", no_trace)
    for out, why in ((tmp_path, "is a directory"),
                     ("/proc/d.json", "cannot write there"),  # /proc: not writable, even by root
                     # a path through a file (was "the directory .../f.toml does not exist; create it")
                     (tmp_path / "f.toml" / "d.json", f"{tmp_path / 'f.toml'} is a file, not a directory")):
        (tmp_path / "f.toml").touch()
        argv = ["--config", "configs/tiny.toml", "--world", "2", "--json", str(out)]
        assert dryrun_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--json {out}: {why}" in err[0], err


def test_cli_world_error_names_this_commands_flag(capsys):
    """A world the layout does not fit: the fix names --world (dryrun's flag), not --nproc, once."""
    from zerotron.analysis.dryrun_cli import dryrun_main

    assert dryrun_main(["--config", "configs/tiny.toml", "--world", "3", "--parallel.tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--world" in err[0] and "--nproc" not in err[0], err
    assert err[0].count("world size 3") == 1, err


def test_traced_flops_equal_the_formula(dry, recompute_dry):
    """The FLOPs counted on the traced step by torch's formulas (``analysis.trace_time.StepCounter``)
    equal the planner's 6W + 12hS per token and layer (+ 6hV on the last stage) per tp rank
    (``flops.m_flops``), plus one documented difference: CPU flash attention's backward is counted
    by torch at 2.5x its forward (it recomputes the scores: 5 matmuls against the forward's 2),
    where 12hS counts 2x (8hS backward for 4hS forward), so the trace holds half the attention
    forward more. A math-attention kernel (bmm) would match the formula exactly. With
    recomputation (full and selective, GPT-2 and Llama, with tp) the same: the formula counts what
    torch's checkpoint re-runs (``flops.recompute_flops``: not a sub-layer's last matmul)."""
    import math

    for name, recs in {**dry, **recompute_dry}.items():
        for rec in recs:
            by_op = rec["counts_traced"]["flops_by_op"]
            extra = by_op.get("_scaled_dot_product_flash_attention_for_cpu_backward", 0) / 5  # 2.5x vs 2x
            assert math.isclose(rec["flops_traced"], rec["flops_formula"] + extra, rel_tol=1e-12), (name, rec["rank"],
                                                                                                    by_op)
            assert rec["counts_traced"]["element_passes"] > 0 and rec["counts_traced"]["ops"] > 0


@pytest.fixture(scope="module")
def recompute_dry():
    """Rank 0 of recomputing layouts (GPT-2 and Llama: full and selective, with tp)."""
    from zerotron.analysis.dryrun import dry_run

    out = {}
    for path in ("configs/tiny.toml", "configs/llama_tiny.toml"):
        for ov in ({"parallel.dp": 4, "train.activation_checkpointing": "full"},
                   {"parallel.dp": 2, "parallel.tp": 2, "train.activation_checkpointing": "selective"}):
            out[f"{path}-{ov}"] = dry_run(tiny_config({**BASE, **ov}, path=path), WORLD, ranks=[0])
    return out


def test_step_time_from_the_trace(dry):
    """The trace's step time on a made-up machine, priced by hand from the record's own counts:
    without a pipeline it is compute + element passes + launch overhead + every data-parallel
    collective (no overlap); a group that spans two nodes takes the inter-node link."""
    from dataclasses import replace

    from zerotron.analysis.dryrun import predict_step_time
    from zerotron.analysis.hardware import busbw_factor, custom_hardware
    from zerotron.plan import build_plan

    cfg = _cfg(dict(LAYOUTS)["ddp-dp4"])
    plan = build_plan(cfg, WORLD)
    recs = [dict(r) for r in dry["ddp-dp4"] if r["rank"] == 0]
    hw = custom_hardware("t", peak_flops=1e12, memory=10**12, busbw=1e9, vector_rate=1e10, latency=1e-5)
    hw = replace(hw, inter={op: 1e8 for op in hw.inter})  # the inter-node link 10x slower
    layers = tiny_config().model.n_layer
    rec = recs[0]
    by_call = [(k.split("/")[0], c) for k, c in rec["comm_traced"]["dp"]["ops"].items()]
    for per_node, bw in ((8, 1e9), (2, 1e8)):
        st = predict_step_time(cfg, plan, recs, hw, gpus_per_node=per_node, compute_eff=1.0, launch_s=1e-4)
        dp = sum(c["calls"] * 1e-5 + c["bytes"] * busbw_factor(op, 4) / bw for op, c in by_call)
        want = rec["flops_traced"] / 1e12 + rec["counts_traced"]["element_passes"] / 1e10 + layers * 1e-4 + dp
        assert abs(st["trace"]["step_s"] - want) <= 1e-12 * want, (per_node, st, want)
        assert rec["group_scopes"]["dp"] == {"size": 4, "intra": per_node == 8}
        assert st["formula"] is not None and st["ratio"] == st["trace"]["step_s"] / st["formula"]["step_s"]


def test_bench_plan_trace(tmp_path):
    """``zerotron bench plan --trace`` ranks the dry-run trace's predicted tokens/s against the
    measured ones (three committed layouts, the committed profile: no measurement)."""
    from zerotron.bench.validate_plan import main

    rows = [r for r in json.loads(open("benchmarks/planner_layouts_cpu.json").read())
            if r["layout"] in ("single", "dp", "tp", "dp-torch")]
    (tmp_path / "t.json").write_text(json.dumps(rows))
    out = tmp_path / "v.json"
    assert main(["--bench-train", str(tmp_path / "t.json"), "--bench-comm", "benchmarks/comm_cpu.json",
                 "--profile", "benchmarks/planner_validation.json", "--trace", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    by = {p["layout"]: p for p in res["layouts"]}
    assert "torch DDP" in by["dp-torch"]["trace_error"] or "dp_impl" in by["dp-torch"]["trace_error"]
    for name in ("single", "dp", "tp"):
        assert by[name]["trace_tokens_per_s"] > 0 and by[name]["trace_flops"] > 0, by[name]
    assert by["single"]["trace_flops"] == 2 * by["dp"]["trace_flops"]  # dp 2 halves each rank's tokens
    assert res["spearman_variants"]["trace_n"] == 3 and -1 <= res["spearman_variants"]["trace"] <= 1


def test_context_parallel_dry_run():
    """cp 2 (ring) x dp 2: the dry run cuts each sequence to the rank's zigzag chunks, as the trainer
    does; the ring's messages (send + recv) equal the planner's bytes exactly, the dp x cp group's
    the planner's gradient all-reduce plus the bookkeeping all-reduces it does not price (token
    count, used-parameter flags, metrics: under 1 KiB), and the model states the estimator's
    (sharded over dp x cp)."""
    from zerotron.analysis.dryrun import dry_run

    rec = dry_run(_cfg({"parallel.cp": 2, "parallel.dp": 2}), WORLD, ranks=[0])[0]
    assert rec["comm_bytes_traced"]["cp"] == rec["comm_bytes_planned"]["cp"] > 0, rec["comm_traced"]
    assert rec["comm_bytes_traced"]["batch"] - rec["comm_bytes_planned"]["batch"] < 1024, rec["comm_traced"]
    assert rec["ratios"]["model_states"] == 1.0
    assert rec["step_time"]["formula"] is not None and rec["step_time"]["formula"]["breakdown_s"]["cp_comm"] >= 0


def test_moe_refused_in_one_line(capsys):
    """A mixture-of-experts config: one line, exit 2 (its routing has data-dependent shapes that
    fake tensors cannot trace), not a traceback."""
    from zerotron.analysis.dryrun_cli import dryrun_main

    assert dryrun_main(["--config", "configs/moe_tiny.toml", "--world", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mixture-of-experts" in err[0], err


def test_caller_process_group_survives(single_process):
    """A dry run in a process that holds a world-1 default group (a test's reference runs, then
    later tests) gives it back: the fake group is only there during the trace."""
    import torch.distributed as dist

    from zerotron.analysis.dryrun import dry_run

    assert dist.is_initialized() and dist.get_world_size() == 1
    dry_run(_cfg({"parallel.dp": 2}), 2, ranks=[0])
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    t = torch.ones(3)
    dist.all_reduce(t)  # a working group, not the fake one
    assert t.tolist() == [1.0, 1.0, 1.0]
