"""Tests for zerotron.bench.train (training-throughput benchmark).

Pure helpers on known inputs; one in-process world-size-1 run (skipped layouts do not crash the
run); one 2-process end-to-end run through the CLI (~20 s) whose communication and model-state
bytes are checked against the exact formulas for the tiny model."""
import json
import os
from pathlib import Path

import pytest

from zerotron.analysis.flops import gpt_num_params
from zerotron.bench import train as bt
from zerotron.cli.main import main as zerotron_main
from zerotron.config import load_config
from zerotron.testing import run_ranks_captured, tiny_config
from zerotron.testing_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.toml"


def test_parse_layouts():
    assert bt.parse_layouts(bt.DEFAULT_LAYOUTS) == ["dp", "dp-torch", "single"]
    assert bt.parse_layouts(" single, dp ,single,") == ["single", "dp"]
    for bad in ("dp,bogus", "", " , ", "dp-mb0", "-mb4", "dp-acnone", "dp-mb4-mb2", "bogus-mb4"):
        with pytest.raises(ValueError, match="valid layouts: dp, dp-torch, single"):
            bt.parse_layouts(bad)
    lay = bt.get_layout("zero2-mb4-acfull")
    assert lay.name == "zero2-mb4-acfull" and lay.new_strategy and lay.world is None
    assert lay.overrides == {"parallel.zero_stage": 2, "train.micro_batch": "4",
                             "train.activation_checkpointing": "full"}
    assert bt.get_layout("single-acselective").world == 1 and bt.get_layout("dp") is bt.LAYOUTS["dp"]
    cfg = load_config(TINY, [(k, str(v).format(world=2)) for k, v in lay.overrides.items()])
    assert (cfg.train.micro_batch, cfg.train.activation_checkpointing) == (4, "full")
    # the pipeline executor's p2p posting mode: a bench knob on native pipeline layouts only
    for name, want in (("pp-1f1b-p2pbatched-mb2", "batched"), ("pp-zb-h1-mb2-p2peager", "eager"), ("pp-1f1b-mb2", None)):
        got = bt.get_layout(name)
        assert got.p2p == want and got.overrides["train.micro_batch"] == "2" and got.name == name
    for bad in ("pp-torch-1f1b-p2pbatched", "dp-p2peager", "pp-threads-gpipe-p2pbatched"):
        with pytest.raises(ValueError, match="applies to the native multi-process pipeline layouts"):
            bt.parse_layouts(bad)
    with pytest.raises(ValueError, match="valid layouts"):
        bt.parse_layouts("pp-1f1b-p2pfast")
    # LoRA adapters: -lora (rank 8) or -loraN
    assert bt.get_layout("dp-lora").overrides == {"parallel.dp_impl": "native", "train.lora_rank": "8"}
    assert bt.get_layout("zero3-lora4-mb2").overrides == {"parallel.zero_stage": 3, "train.lora_rank": "4",
                                                          "train.micro_batch": "2"}
    with pytest.raises(ValueError, match="valid layouts"):
        bt.parse_layouts("dp-lora0")


@pytest.mark.parametrize("name", list(bt.LAYOUTS))
def test_every_layout_names_real_config_fields(name):
    """A layout's overrides must be config fields of the right type (a typo would silently skip it)."""
    lay = bt.LAYOUTS[name]
    cfg = load_config(TINY, [(k, str(v).format(world=4)) for k, v in lay.overrides.items()])
    for key, value in lay.overrides.items():
        section, fld = key.split(".")
        assert str(getattr(getattr(cfg, section), fld)).lower() == str(value).format(world=4).lower()


def test_paired_ratio():
    assert bt.paired_ratio([2.0, 4.0, 9.0], [1.0, 2.0, 3.0]) == 2.0  # per-round ratios 2, 2, 3
    assert bt.paired_ratio([10.0, 1.0], [5.0, 1.0]) == 1.5  # median of 2 and 1, not 11/6
    assert bt.paired_ratio([1.0], [1.0, 2.0]) is None
    assert bt.paired_ratio([], []) is None
    assert bt.paired_ratio([1.0, 2.0], [0.0, 1.0]) is None


def _rec(layout, r, tps, world=2, impl="DataParallel"):
    return {"layout": layout, "round": r, "world_size": world, "skipped": False, "impl": impl, "tokens_per_s": tps,
            "step_time_s": 1000.0 / tps, "step_times_s": [1000.0 / tps], "cpu_s_per_step": 0.5 + r,
            "comm_bytes_per_step": 100 + r,
            "model_state_bytes": 1600, "peak_mem_bytes": (r + 1) * 2**20, "num_params": 100, "tokens_per_step": 1000,
            "steps": 1, "warmup": 0}


def test_summarize_and_format_table():
    recs = [_rec("dp", 0, 300.0), _rec("dp-torch", 0, 200.0, impl="TorchDDP"), _rec("single", 0, 150.0, world=1),
            _rec("dp", 1, 100.0), _rec("dp-torch", 1, 100.0, impl="TorchDDP"), _rec("single", 1, 100.0, world=1),
            _rec("dp", 2, 330.0), _rec("dp-torch", 2, 300.0, impl="TorchDDP"), _rec("single", 2, 110.0, world=1)]
    skip = {"layout": "tp", "world_size": 2, "skipped": True, "error": "ConfigError: tp | not yet"}
    rows = bt.summarize(recs + [{**skip, "round": r} for r in range(3)])
    by = {r["layout"]: r for r in rows}
    assert [r["layout"] for r in rows] == ["dp", "dp-torch", "single", "tp"]
    dp = by["dp"]
    assert dp["tokens_per_s"] == 300.0 and dp["tokens_per_s_rounds"] == [300.0, 100.0, 330.0]
    assert dp["step_time_s"] == pytest.approx(1000 / 300)
    assert dp["ratio_vs_dp-torch"] == pytest.approx(1.1)  # per round 1.5, 1.0, 1.1
    assert dp["ratio_vs_single"] == pytest.approx(2.0)  # per round 2.0, 1.0, 3.0
    assert by["dp-torch"]["ratio_vs_dp-torch"] == 1.0 and by["single"]["ratio_vs_single"] == 1.0
    assert dp["comm_bytes_per_step"] == 102 and dp["peak_mem_bytes"] == 3 * 2**20 and dp["rounds"] == 3
    assert by["tp"] == skip
    table = bt.format_table(rows).splitlines()
    assert table[0].startswith("| layout | impl | world | tokens/s median") and "vs dp-torch | vs single" in table[0]
    assert len(table) == 2 + 4 and all(line.count("|") == table[0].count("|") for line in table)
    assert dp["cpu_s_per_step"] == 1.5
    assert table[2] == "| dp | DataParallel | 2 | 300 | 100-330 | 3333.3 | 1.100 | 2.000 | 1.500 | 102 | 1,600 | 3 |"
    assert "skipped: ConfigError: tp / not yet" in table[5]
    # a 1-rank layout shows no comm bytes (its all-reduces move nothing): the JSON keeps the count
    assert table[4].startswith("| single | DataParallel | 1 |") and "| - (1 rank) |" in table[4], table[4]
    assert by["single"]["comm_bytes_per_step"] == 102


def test_impl_name_of_tensor_parallel_layouts():
    class DataParallel:
        tp_group = None

    class ZeroStrategy:
        tp_group = object()

    tp = DataParallel()
    assert bt.impl_name(tp, dp=2) == "DataParallel"
    tp.tp_group = object()  # the tp layout: a TP model under a data-parallel wrapper over 1 dp rank
    assert bt.impl_name(tp, dp=1) == "TensorParallel" and bt.impl_name(tp, 1, True) == "TensorParallel+SP"
    assert bt.impl_name(tp, dp=2) == "TensorParallel x DataParallel"
    assert bt.impl_name(ZeroStrategy(), dp=2) == "TensorParallel x ZeroStrategy"


def test_summarize_epoch_and_bubble_fields():
    """epoch_time_s = epoch tokens / median tokens/s; bubble_measured = median over all timed steps of
    all rounds; the extra table columns appear only when some row has them."""
    recs = [{**_rec("pp-1f1b", r, tps, impl="PipelineStrategy"), "epoch_tokens": 6000, "bubble_theory": 1 / 3,
             "bubble_measured": 0.0, "bubble_measured_steps": steps}
            for r, tps, steps in ((0, 100.0, [0.2, 0.4]), (1, 300.0, [0.3]), (2, 200.0, [0.5, 0.6]))]
    recs += [{**_rec("dp", r, 200.0), "epoch_tokens": 6000} for r in range(3)]
    rows = {r["layout"]: r for r in bt.summarize(recs)}
    pp, dp = rows["pp-1f1b"], rows["dp"]
    assert pp["epoch_time_s"] == pytest.approx(6000 / 200) and dp["epoch_time_s"] == pytest.approx(30.0)
    assert pp["bubble_measured"] == pytest.approx(0.4) and pp["bubble_theory"] == pytest.approx(1 / 3)
    assert "bubble_measured_steps" not in pp and "bubble_measured" not in dp
    table = bt.format_table(list(rows.values())).splitlines()
    assert table[0].endswith("| peak mem MiB | epoch s | bubble measured | bubble theory |")
    assert table[2].endswith("| 30.0 | 0.400 | 0.333 |") and table[3].endswith("| 30.0 | - | - |")
    # bubble accounting: the simulator's prediction from measured stage times, paired per step
    for r, sim in zip(recs[:3], ([0.1, 0.2], [0.25], [0.5, 0.4])):
        r.update(bubble_simulated=0.0, bubble_simulated_steps=sim, pp_split="3,1",
                 stage_compute_s={"F": {0: 0.01 * (1 + r["round"]), 1: 0.02}, "B": {0: 0.03, 1: 0.04}})
    rows = {r["layout"]: r for r in bt.summarize(recs)}
    pp = rows["pp-1f1b"]
    assert pp["bubble_simulated"] == pytest.approx(0.25) and "bubble_simulated_steps" not in pp
    assert pp["bubble_overhead_ratio"] == pytest.approx(1.5)  # median of 2, 2, 1.2, 1, 1.5
    assert pp["stage_compute_s"] == {"F": {0: pytest.approx(0.02), 1: 0.02}, "B": {0: 0.03, 1: 0.04}}
    table = bt.format_table(list(rows.values())).splitlines()
    assert table[0].endswith("| epoch s | split | bubble measured | bubble sim (measured F/B) | measured / sim "
                             "| bubble theory |")
    assert table[2].endswith("| 30.0 | 3,1 | 0.400 | 0.250 | 1.50 | 0.333 |"), table[2]
    assert table[3].endswith("| 30.0 | - | - | - | - | - |")
    # executor overhead columns: medians over all timed steps of all rounds, replay ratio paired per step
    for r, rep in zip(recs[:3], ([0.1, 0.2], [0.3], [0.25, 0.5])):
        r.update(bubble_replayed_steps=rep, idle_split_steps=[
            {"idle_dependency": b / 2, "idle_transfer": 0.01 * (1 + r["round"]), "idle_post": 0.02,
             "other_fraction": 0.001, "start_skew_ms": 1.0 + r["round"]} for b in r["bubble_measured_steps"]])
    pp = {r["layout"]: r for r in bt.summarize(recs)}["pp-1f1b"]
    assert pp["bubble_replayed"] == pytest.approx(0.25) and pp["bubble_replay_ratio"] == pytest.approx(2.0)  # 2, 2, 1, 2, 1.2
    assert pp["idle_dependency"] == pytest.approx(0.2) and pp["idle_transfer"] == pytest.approx(0.02)
    assert pp["start_skew_ms"] == pytest.approx(2.0) and "idle_split_steps" not in pp
    table = bt.format_table([pp]).splitlines()
    assert table[0].endswith("| bubble measured | idle: wait for sender | idle: p2p transfer | idle: post + send wait "
                             "| start skew ms | bubble sim (measured F/B) | measured / sim | bubble replay (per-action "
                             "times) | measured / replay | bubble theory |"), table[0]
    assert table[2].endswith("| 0.400 | 0.200 | 0.020 | 0.020 | 2.0 | 0.250 | 1.50 | 0.250 | 2.00 | 0.333 |"), table[2]


def test_bad_arguments_exit_2(capsys):
    from zerotron.cli import main as cli_main

    assert cli_main(["bench", "train", "--layouts", "dp,nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "valid layouts: dp, dp-torch, single" in err
    assert bt.main(["--steps", "0"]) == 2
    assert bt.main(["--config", str(TINY), "--train.no_such_field", "1"]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert bt.main(["--config", str(TINY), "--nproc", "3"]) == 2  # global_batch 8 not divisible by 4 * 3
    assert bt.main(["--bogus-flag"]) == 2


@pytest.mark.parametrize("command", ["train", "context"])
def test_plan_refusal_before_launch(capsys, monkeypatch, command):
    """A layout the plan refuses (cp 3 on 2 processes: not a factor of the world): one line, exit 2,
    before any worker starts -- in ``bench train`` and ``bench context`` alike (their shared
    prologue, ``bench.entry``)."""
    from zerotron.bench import context as bc
    from zerotron.bench import entry

    monkeypatch.setattr(entry, "launch", lambda *a, **k: pytest.fail("workers launched for a refused plan"))
    capsys.readouterr()
    main = bt.main if command == "train" else bc.main
    assert main(["--config", str(TINY), "--nproc", "2", "--parallel.cp", "3", "--layouts", "dp"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"zerotron bench {command}: error: ") and "cp" in err[0], err


def test_in_process_skips_unbuildable_layouts(monkeypatch, data_cache, single_process):
    """World size 1: 'single' runs; a config refused by build_plan() and a strategy parallelize() does
    not provide are reported as skipped (with the error), and the run goes on."""
    from zerotron.data import prepare_data

    extra = {"bad-batch": bt.Layout("bad-batch", {"train.global_batch": 6}),
             "fake-zero": bt.Layout("fake-zero", {"parallel.dp_impl": "torch"}, new_strategy=True)}
    from zerotron.bench import layouts

    monkeypatch.setattr(layouts, "LAYOUTS", {**layouts.LAYOUTS, **extra})
    cfg = tiny_config({"data.cache_dir": data_cache})
    d = cfg.data
    data = prepare_data(d.corpus, None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir)
    import torch

    over = [("data.cache_dir", data_cache)]
    recs = bt.run_benchmark(TINY, over, ["bad-batch", "single", "fake-zero"], 1, 0, 2, torch.device("cpu"), data)
    assert [(r["round"], r["layout"]) for r in recs] == [
        (0, "bad-batch"), (0, "single"), (0, "fake-zero"), (1, "single"), (1, "fake-zero"), (1, "bad-batch")]
    rows = {r["layout"]: r for r in bt.summarize(recs)}
    assert rows["bad-batch"]["skipped"] and "global_batch (6)" in rows["bad-batch"]["error"]
    assert rows["fake-zero"]["skipped"] and "NotImplementedError" in rows["fake-zero"]["error"]
    assert "TorchDDP" in rows["fake-zero"]["error"]
    single = rows["single"]
    assert not single["skipped"] and single["world_size"] == 1 and single["tokens_per_s"] > 0
    assert single["tokens_per_step"] == 8 * 64 and single["steps"] == 1 and single["rounds"] == 2


def test_two_process_end_to_end(tmp_path, data_cache):
    js, png, md = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "t.md"
    cmd = ["bench", "train", "--nproc", "2", "--config", str(TINY), "--steps", "2",
           "--warmup", "1", "--rounds", "1", "--layouts", "dp,dp-torch,single,pp-1f1b", "--json", str(js),
           "--plot", str(png), "--markdown", str(md),
           "--log.progress", "false", "--data.cache_dir", data_cache]
    p = run_cli(cmd, timeout=240, cwd=ROOT, env={**os.environ})  # `python -m zerotron ...` from the fork server
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {r["layout"]: r for r in json.loads(js.read_text())}
    assert list(rows) == ["dp", "dp-torch", "single", "pp-1f1b"]
    n_params = gpt_num_params(n_layer=4, n_head=4, n_embd=64, vocab_size=512, block_size=64)  # tiny.toml
    # per step: one fp32 gradient all-reduce of every (unique) parameter, plus two float64 scalars:
    # the global target-token count (tag loss_norm) and the loss sum (tag metrics)
    # native DDP: plus one fp32 "gradient used" flag per parameter tensor (wte, wpe, 12 per block,
    # ln_f), summed over dp so a parameter no rank used is skipped like on one process
    n_tensors = 2 + 4 * 12 + 2
    for name, world, impl in (("dp", 2, "DataParallel"), ("dp-torch", 2, "TorchDDP"), ("single", 1, "DataParallel")):
        used = {"grad_used": 4 * n_tensors} if impl == "DataParallel" else {}
        want_tags = {"grad": 4 * n_params, "loss_norm": 8, "metrics": 8, **used}
        r = rows[name]
        assert not r["skipped"] and r["world_size"] == world and r["impl"] == impl, r
        assert r["num_params"] == n_params and r["tokens_per_step"] == 8 * 64
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and len(r["step_times_s_rounds"][0]) == 2
        # tokens/s is global tokens over wall time: within [1, 2] x tokens_per_step / median step time (2 steps)
        assert 0 < r["cpu_s_per_step"] < 60
        assert 0.95 <= r["tokens_per_s"] * r["step_time_s"] / r["tokens_per_step"] <= 2.05
        assert r["comm_bytes_by_tag"] == want_tags  # single: all-reduces over a 1-rank group, counted alike
        assert r["comm_bytes_per_step"] == 4 * n_params + 16 + sum(used.values())
        assert r["model_state_bytes"] == 16 * n_params  # fp32 params + grads + Adam exp_avg, exp_avg_sq
        assert r["peak_mem_bytes"] > 50 * 2**20
    assert rows["dp-torch"]["ratio_vs_dp-torch"] == 1.0 and rows["single"]["ratio_vs_single"] == 1.0
    # one epoch of the train split at the measured speed; pipeline bubble measured and in theory
    epoch_tokens = rows["dp"]["epoch_tokens"]
    assert epoch_tokens > 10 * 8 * 64 and epoch_tokens % 64 == 0
    for r in rows.values():
        assert r["epoch_tokens"] == epoch_tokens
        assert r["epoch_time_s"] == pytest.approx(epoch_tokens / r["tokens_per_s"]) and r["epoch_time_s"] > 0
    pp = rows["pp-1f1b"]
    assert not pp["skipped"] and pp["impl"] == "PipelineStrategy", pp
    assert pp["bubble_theory"] == pytest.approx(1 / 3)  # pp = 2, m = 8 / 4 = 2 micro-batches: 1/(2+1)
    assert 0 <= pp["bubble_measured"] < 1
    assert all("bubble_measured" not in rows[k] for k in ("dp", "dp-torch", "single"))
    # accounting: the simulator fed with the measured F/B time of each stage (both stages measured)
    assert pp["pp_split"] == "2,2"  # tiny.toml: the head costs 0.6 blocks, so "auto" keeps the even split
    st = pp["stage_compute_s"]
    assert sorted(st) == ["B", "F"] and all(sorted(st[k]) == ["0", "1"] and min(st[k].values()) > 0 for k in st)
    assert 0 <= pp["bubble_simulated"] < 1 and pp["bubble_overhead_ratio"] > 0
    # executor overhead: the idle split (fractions of the walk) and the replay of per-action times
    assert min(pp["idle_dependency"], pp["idle_transfer"], pp["idle_post"], pp["start_skew_ms"]) >= 0
    assert pp["idle_dependency"] + pp["idle_transfer"] + pp["idle_post"] < 1 and 0 <= pp["other_fraction"] < 0.5
    assert 0 < pp["bubble_replayed"] < 1 and pp["bubble_replay_ratio"] > 0
    assert "idle_split_steps" not in pp and "bubble_replayed_steps" not in pp
    assert 0 < pp["p2p_latency_ms"] < 1000  # some receive waited for its send on loopback gloo
    # the simulation with that latency on every message predicts at least the latency-free idle
    assert pp["bubble_simulated"] <= pp["bubble_sim_latency"] < 1 and pp["latency_ratio"] > 0
    dp, torch_dp = rows["dp"], rows["dp-torch"]
    assert dp["ratio_vs_dp-torch"] == pytest.approx(dp["tokens_per_s"] / torch_dp["tokens_per_s"])  # 1 round
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "zerotron bench train --nproc 2 --config" in text and "| dp | DataParallel | 2 |" in text
    assert "| single | DataParallel | 1 |" in text and "gloo, 2 rank(s)" in text
    assert ("| epoch s | split | bubble measured | idle: wait for sender | idle: p2p transfer | idle: post + send wait "
            "| start skew ms | p2p latency ms | bubble sim (measured F/B) | measured / sim | bubble replay (per-action times) "
            "| measured / replay | bubble sim + p2p latency | measured / (sim + latency) | bubble theory |") in text
    assert "| 0.333 |" in text and "| 2,2 |" in text
    assert "| dp-torch | TorchDDP | 2 |" in p.stdout and "dp / dp-torch tokens/s:" in p.stdout


def test_model_splitting_layouts_on_one_rank_say_so():
    """tp/pp layouts on one rank are refused as such (not as "not implemented yet")."""
    from types import SimpleNamespace

    one = SimpleNamespace(dims=SimpleNamespace(world_size=1))
    for name in ("tp", "tp-sp-mb4", "pp-1f1b", "tp-dtensor"):
        with pytest.raises(ValueError, match=r"needs 2 or more ranks \(--nproc 2\)") as e:
            bt._build(None, None, one, None, bt.get_layout(name), 1)
        assert f"layout {name} sets parallel." in str(e.value)


def test_hsdp_vs_flat_ratio_and_link_bytes_columns():
    recs = []
    for r, (flat, hier) in enumerate(((100.0, 180.0), (120.0, 180.0), (90.0, 200.0))):
        recs += [{**_rec("zero3", r, flat, impl="ZeroStrategy"), "link_tx_bytes_per_step": 900 + r},
                 {**_rec("hsdp-zero3", r, hier, impl="ZeroStrategy"), "link_tx_bytes_per_step": 300 + r},
                 {**_rec("dp-hier-mb2", r, hier)}]
    by = {x["layout"]: x for x in bt.summarize(recs)}
    assert by["hsdp-zero3"]["ratio_vs_flat"] == pytest.approx(1.8)  # per round 1.8, 1.5, 2.22
    assert by["hsdp-zero3"]["link_tx_bytes_per_step"] == 301 and by["zero3"]["link_tx_bytes_per_step"] == 901
    assert by["hsdp-zero3"]["link_bytes_vs_flat"] == pytest.approx(301 / 901)
    assert "ratio_vs_flat" not in by["zero3"] and "ratio_vs_flat" not in by["dp-hier-mb2"]  # no dp-mb2 here
    head = bt.format_table(list(by.values())).splitlines()[0]
    assert head.endswith("| tokens/s vs flat | link bytes/step | link bytes vs flat |"), head


def test_offload_hidden_and_vs_no_offload_columns():
    """Offload layouts: ``offload_hidden`` (and the disk tier's ``offload_io_hidden``) are medians over
    rounds; ``ratio_vs_no_offload`` pairs each round with the same stage without offload."""
    recs = []
    for r, (plain, off, hid) in enumerate(((100.0, 90.0, 0.5), (120.0, 60.0, 0.7), (80.0, 72.0, 0.6))):
        recs += [_rec("zero1", r, plain, impl="ZeroStrategy"),
                 {**_rec("zero1-offload", r, off, impl="ZeroStrategy"), "offload_hidden": hid,
                  "offload_copy_s_per_step": 0.01, "offload_wait_s_per_step": 0.01 * (1 - hid)},
                 {**_rec("zero1-offdisk-mb2", r, off, impl="ZeroStrategy"), "offload_hidden": hid,
                  "offload_io_hidden": hid / 2}]
    by = {x["layout"]: x for x in bt.summarize(recs)}
    assert by["zero1-offload"]["ratio_vs_no_offload"] == pytest.approx(0.9)  # per round 0.9, 0.5, 0.9
    assert by["zero1-offdisk-mb2"]["ratio_vs_no_offload"] == pytest.approx(0.9)
    assert by["zero1-offload"]["offload_hidden"] == pytest.approx(0.6)
    assert by["zero1-offdisk-mb2"]["offload_io_hidden"] == pytest.approx(0.3)
    assert "ratio_vs_no_offload" not in by["zero1"] and "offload_hidden" not in by["zero1"]
    head = bt.format_table(list(by.values())).splitlines()[0]
    assert head.endswith("| tokens/s vs no offload | host copies hidden | disk I/O hidden |"), head


def test_link_bytes_read_from_the_interface_counter(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert bt._link_tx_bytes() is None  # loopback is not a link between nodes
    ifname = next((n for n in sorted(os.listdir("/sys/class/net")) if n != "lo"), None)
    if ifname is None:
        pytest.skip("no network interface besides lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", ifname)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert bt._link_tx_bytes() is None  # one reader per node: local rank 0
    monkeypatch.setenv("LOCAL_RANK", "0")
    want = int(open(f"/sys/class/net/{ifname}/statistics/tx_bytes").read())
    assert want <= bt._link_tx_bytes() <= want + 10**9


def test_context_parallel_layouts_count_the_whole_global_batch(tmp_path, data_cache):
    """cp 2 on 2 processes: the plan's dims build the mesh (the ring and a2a really run: their
    transfers are counted), each step trains the whole global batch (tokens per step equal dp's,
    gradients all-reduced over dp x cp), and dp x cp on 2 processes is skipped naming the 4 ranks."""
    js = tmp_path / "cp.json"
    cmd = ["bench", "train", "--config", str(TINY), "--steps", "1", "--warmup", "0",
           "--rounds", "1", "--layouts", "dp,cp-ring,cp-a2a,dp-cp-ring", "--json", str(js),
           "--log.progress", "false", "--data.cache_dir", data_cache]
    # as each worker of `bench train --nproc 2` runs it, on the pooled ranks (2 fresh interpreters
    # fewer): the launch itself is test_two_process_end_to_end's
    ranks = run_ranks_captured(zerotron_main, 2, cmd, join_timeout_s=300)
    assert [code for code, _, _ in ranks] == [0, 0], ranks
    rows = {r["layout"]: r for r in json.loads(js.read_text())}
    dp, ring, a2a = rows["dp"], rows["cp-ring"], rows["cp-a2a"]
    assert ring["impl"] == "DataParallel x CP2 (ring)" and a2a["impl"] == "DataParallel x CP2 (a2a)", (ring, a2a)
    for r in (ring, a2a):
        assert r["world_size"] == 2 and r["tokens_per_step"] == dp["tokens_per_step"] == 8 * 64
        assert r["comm_bytes_by_tag"]["grad"] == dp["comm_bytes_by_tag"]["grad"]  # one all-reduce over dp x cp
        assert 0.95 <= r["tokens_per_s"] * r["step_time_s"] / r["tokens_per_step"] <= 1.05  # 1 step: the batch
    # the ring: per hop one K/V block forward and backward, and as many gradient-accumulator hops
    assert ring["comm_bytes_by_tag"]["cp_kv"] == ring["comm_bytes_by_tag"]["cp_dkv"] > 0
    assert a2a["comm_bytes_by_tag"]["cp_a2a"] > 0 and "cp_kv" not in a2a["comm_bytes_by_tag"]
    assert not any(k.startswith("cp_") for k in dp["comm_bytes_by_tag"])
    assert rows["dp-cp-ring"]["skipped"] and "needs 4 ranks" in rows["dp-cp-ring"]["error"]
