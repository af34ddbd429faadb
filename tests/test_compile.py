"""``train.compile = true`` (regional compilation, ``zerotron.parallel.compile``): compiled layouts
train like the eager single process in float64 (rtol 1e-10, the parity matrix's bound and
machinery), with no recompile after the first step.

Inductor compiles C++ kernels on this CPU (tens of seconds per graph on 2 loaded cores), so the
default suite runs ONE small compiled case (the single process, the training entry);
``ZEROTRON_COMPILE=full`` (``make test-compile``) adds dp2, ZeRO-3 dp2, tp2+SP,
pp2-1f1b, pp2-zb-h1 and activation checkpointing on GPT-2 and Llama, with evaluation."""
import json
import os

import pytest
import torch

from zerotron import parity
from zerotron.config import ConfigError
from zerotron.dims import ParallelDims
from zerotron.plan import ParallelPlan
from zerotron.testing import run_ranks

FULL = os.environ.get("ZEROTRON_COMPILE", "") == "full"
COMPILED = {"train.compile": "true"}
# (name, world): compiled vs the eager single process, same matrix model and batch
LAYOUTS = ["ddp-dp2-acc1", "zero3-dp2-acc4", "ddp-dp1-tp2sp-acc1", "ddp-dp1-pp2-1f1b-acc4", "ddp-dp1-pp2-zb-h1-acc4",
           "zero3-dp2-acc4-acfull"]


def _run_compiled(layouts, ref_path, tmp, extra):
    """Rank body: the parity records of ``layouts`` plus this rank's compile counters."""
    from zerotron.parallel.compile import compile_stats

    recs = parity.run_many(layouts, ref_path, tmp, extra)
    return recs, compile_stats()


def _metrics(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _check(records, ref_keys, name):
    res = parity.check(name, records, ref_keys, parity.FP64_RTOL)
    worst = max(res[k] for k in parity.ERRORS)
    assert worst <= parity.FP64_RTOL, (name, res)
    return worst


def test_compiled_single_process_equals_eager(data_cache, single_process, tmp_path, report, monkeypatch):
    """The whole training path compiled (blocks of the matrix GPT-2, fp64, 2 steps) equals the eager
    run to 1e-10; the counters show a compiled graph, no graph break and no recompile (8 blocks and
    4 micro-batches share the training entry). Evaluation is off here to keep the default suite
    within its budget (one graph to compile, not two); the ``make test-compile`` layouts evaluate
    (compiled evaluation entry, padded batches) and assert the counters flat after step 1."""
    from zerotron.parallel.compile import compile_stats

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    extra = {"data.cache_dir": data_cache, "train.eval_every": 0}
    ref = parity.reference(str(tmp_path / "ref"), extra)
    ref_path = str(tmp_path / "ref.pt")
    torch.save(ref, ref_path)
    before = compile_stats()
    lay = parity.Layout("ddp", 1, 1, False, 1, None, 4)  # 4 micro-batches: the entry is reused
    rec = parity.run_many([lay.as_dict()], ref_path, str(tmp_path / "c"), {**extra, **COMPILED})[0]
    after = compile_stats()
    worst = _check([rec], (set(ref["params"]), set(ref["optim"])), lay.name)
    assert after["graphs"] - before["graphs"] >= 1, (before, after)  # the training graph
    assert after["recompiles"] == 0 and after["graph_breaks"] == before["graph_breaks"], after
    assert after["compile_time_s"] > before["compile_time_s"]
    # the run's metrics carry the counters, flat after the first step
    steps = [r for r in _metrics(tmp_path / "c" / lay.name) if "loss" in r]
    assert all(r["recompiles"] == 0 for r in steps) and steps[0]["compile_time_s"] > 0, steps
    assert steps[-1]["compile_time_s"] == steps[0]["compile_time_s"], steps  # nothing compiled after step 1
    report(f"compile: single process fp64 compiled vs eager worst rel err {worst:.3g}; "
           f"{after['graphs'] - before['graphs']} graphs, {after['compile_time_s'] - before['compile_time_s']:.1f} s compiling")


@pytest.mark.skipif(not FULL, reason="ZEROTRON_COMPILE=full (make test-compile): compiled multi-rank layouts")
@pytest.mark.parametrize("family", list(parity.MODELS))
def test_compiled_layouts_equal_eager(family, data_cache, single_process, tmp_path, report, monkeypatch):
    """dp2, ZeRO-3, tp2+SP, pp2 1F1B and ZB-H1, activation checkpointing: compiled equals the eager
    single process (fp64, rtol 1e-10), no recompile on any rank."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    extra = {"data.cache_dir": data_cache, **parity.MODELS[family]}
    ref = parity.reference(str(tmp_path / "ref"), extra)
    ref_path = str(tmp_path / "ref.pt")
    torch.save(ref, ref_path)
    lays = {l.name: l.as_dict() for l in parity.all_layouts(2) if l.name in LAYOUTS}
    assert sorted(lays) == sorted(LAYOUTS)
    per_rank = run_ranks(_run_compiled, 2, list(lays.values()), ref_path, str(tmp_path / "c"), {**extra, **COMPILED},
                         timeout_s=600, join_timeout_s=3000, fresh=True)
    worst = {}
    for i, name in enumerate(lays):
        worst[name] = _check([per_rank[r][0][i] for r in range(2)], (set(ref["params"]), set(ref["optim"])), name)
    for name in lays:  # no recompile after the first step (rank 0's metrics: its counters per step)
        steps = [r for r in _metrics(tmp_path / "c" / name) if "loss" in r]
        assert len(steps) == parity.STEPS and len({(r["recompiles"], r["graphs"]) for r in steps}) == 1, (name, steps)
    stats = [s for _, s in per_rank]
    assert all(s["graphs"] > 0 for s in stats), stats
    report(f"compile {family}: compiled vs eager worst rel err {worst}; per-rank counters {stats}")


@pytest.mark.parametrize("over,needle", [
    ({"tp_impl": "dtensor"}, "parallel.tp_impl = dtensor"),
    ({"pp_impl": "threads"}, "parallel.pp_impl = threads"),
    ({}, "parallel.cp > 1"),
])
def test_refused_combinations(over, needle):
    """What cannot be compiled is refused by the plan with the reason, never run eager silently."""
    dims = ParallelDims(2, tp=2) if "tp_impl" in over else ParallelDims(1) if over else ParallelDims(2, cp=2)
    extra = {"virtual_stages": 2, "pp_schedule": "gpipe"} if over.get("pp_impl") == "threads" else {}
    with pytest.raises(ConfigError, match="train.compile") as e:
        ParallelPlan(dims, compile=True, **over, **extra)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bench_compile_suffix_and_rows():
    """``zerotron bench train`` layouts take ``-compile``; rows pair compiled with eager per round and
    show compile time and timed recompiles."""
    from zerotron.bench.layouts import get_layout
    from zerotron.bench.report import format_table, summarize

    assert get_layout("zero3-compile").overrides == {"parallel.zero_stage": 3, "train.compile": "true"}
    assert get_layout("pp-1f1b-mb2-compile").overrides["train.micro_batch"] == "2"
    assert get_layout("dp").overrides.get("train.compile") is None
    base = {"skipped": False, "impl": "DataParallel", "world_size": 2, "step_time_s": 1.0, "step_times_s": [1.0],
            "cpu_s_per_step": 1.0, "comm_bytes_per_step": 0, "peak_mem_bytes": 0, "model_state_bytes": 0}
    recs = [{**base, "layout": "dp", "round": r, "tokens_per_s": 100.0 + r} for r in range(2)]
    recs += [{**base, "layout": "dp-compile", "round": r, "tokens_per_s": 150.0 + 3 * r, "compile_time_s": 30.0 - 30 * r,
              "recompiles": 0, "warmup_s": 40.0} for r in range(2)]
    rows = {r["layout"]: r for r in summarize(recs)}
    assert rows["dp-compile"]["compile_time_s"] == 30.0 and rows["dp-compile"]["recompiles"] == 0
    assert rows["dp-compile"]["ratio_vs_eager"] == pytest.approx((1.5 + 153 / 101) / 2)
    assert "ratio_vs_eager" not in rows["dp"]
    table = format_table(list(rows.values()))
    assert "compiled / eager" in table and "recompiles (timed)" in table
