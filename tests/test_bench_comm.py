"""Tests for zerotron.bench.comm (collective benchmark) and zerotron.bench.topology.

Pure helpers are checked on known inputs; one end-to-end run spawns 2 gloo workers (~10 s)."""
import json
import math
import os
import subprocess
import sys

import pytest

from zerotron.bench import comm as bench
from zerotron.bench.topology import CPU_INTERCONNECT, summarize_topo
from zerotron.distributed.accounting import busbw_factor
from zerotron.launch import strip_nproc

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("op,n,want", [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_reduce", 1, 0.0), ("all_reduce", 8, 1.75),
    ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5),
    ("broadcast", 8, 1.0), ("p2p", 8, 1.0),
])
def test_busbw_factor_nccl_tests_convention(op, n, want):
    assert busbw_factor(op, n) == pytest.approx(want)


def test_bandwidths_known_inputs():
    assert bench.bandwidths("all_reduce", 10**9, 1.0, 4) == pytest.approx((1.0, 1.5))
    assert bench.bandwidths("all_gather", 2 * 10**9, 0.5, 8) == pytest.approx((4.0, 3.5))
    assert bench.bandwidths("reduce_scatter", 3 * 10**9, 2.0, 2) == pytest.approx((1.5, 0.75))
    assert bench.bandwidths("broadcast", 5 * 10**8, 0.25, 16) == pytest.approx((2.0, 2.0))
    assert bench.bandwidths("p2p", 10**6, 1e-3, 2) == pytest.approx((1.0, 1.0))
    with pytest.raises(ValueError, match="time_s"):
        bench.bandwidths("all_reduce", 10, 0.0, 2)
    with pytest.raises(ValueError, match="unknown op"):
        bench.bandwidths("all_sum", 10, 1.0, 2)


@pytest.mark.parametrize("text,want", [
    ("4KiB", 4 * KiB), ("16 MiB", 16 * MiB), ("512B", 512), ("4096", 4096), ("1gib", GiB), (" 3kib ", 3 * KiB),
])
def test_parse_size(text, want):
    assert bench.parse_size(text) == want


@pytest.mark.parametrize("bad", ["", "KiB", "4KB", "4 TiB", "1.5MiB", "-1KiB", "0", "0KiB", "4 K iB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="bad size"):
        bench.parse_size(bad)


def test_parse_sizes_range_and_list():
    assert bench.parse_sizes("1KiB:1MiB") == [KiB << i for i in range(11)]
    assert bench.parse_sizes("4KiB:4KiB") == [4 * KiB]
    assert bench.parse_sizes("1MiB,4KiB, 3MiB,4096") == [4 * KiB, MiB, 3 * MiB]
    assert bench.parse_sizes(bench.DEFAULT_SIZES)[-1] == 16 * MiB


@pytest.mark.parametrize("bad,msg", [
    ("1MiB:1KiB", "lo must be <= hi"), ("3KiB:1MiB", "not a power of two"), ("1KiB:2KiB:4KiB", "lo:hi"),
    ("", "no sizes"), (",", "no sizes"), ("1KiB:", "bad size"), ("4KiB,5XB", "bad size"),
])
def test_parse_sizes_rejects(bad, msg):
    with pytest.raises(ValueError, match=msg):
        bench.parse_sizes(bad)


def test_actual_bytes_and_format_size():
    assert bench.actual_bytes(4096, 2) == 4096
    assert bench.actual_bytes(4096, 3) == 4092  # multiple of 4*3
    assert bench.actual_bytes(4, 3) == 12
    assert [bench.format_size(b) for b in (512, 4096, 3 * MiB, 2 * GiB, 4092)] == [
        "512B", "4KiB", "3MiB", "2GiB", "4092B"]


def test_summarize_topo():
    nvswitch = ("\x1b[4m        GPU0    GPU1    CPU Affinity\x1b[0m\n"
                "GPU0     X      NV18    0-55\nGPU1    NV18     X      0-55\n\nLegend:\n  X    = Self\n")
    pcie = "        GPU0    GPU1\nGPU0     X      SYS\nGPU1    SYS      X\n\nLegend:\n  NV# = NVLink\n"
    assert summarize_topo(nvswitch) == "NVLink/NVSwitch"
    assert summarize_topo(pcie) == "PCIe"  # "NV#" in the legend must not count as a link
    assert summarize_topo("        GPU0\nGPU0     X \n") == "single GPU"
    assert summarize_topo(None) == summarize_topo("") == "unknown"


def test_bad_arguments_exit_2(capsys):
    assert bench.main(["--sizes", "1MiB:1KiB"]) == 2
    assert "lo must be <= hi" in capsys.readouterr().err
    assert bench.main(["--ops", "all_reduce,all_sum"]) == 2
    assert "all_sum" in capsys.readouterr().err
    assert bench.main(["--iters", "0"]) == 2
    assert bench.main(["--bogus"]) == 2
    assert bench.main(["--backend", "mpi"]) == 2
    assert strip_nproc(["--nproc", "2", "--iters", "3", "--nproc=4"]) == ["--iters", "3"]


def test_timing_noise_rule():
    """max/min > 2 or CV > 0.5 of the per-loop times flags a timing; steady ones pass."""
    assert bench.timing_noise([1.0]) == (1.0, 0.0) and bench.timing_noise([]) == (1.0, 0.0)
    spread, cv = bench.timing_noise([1e-3, 1.1e-3, 1.2e-3])
    assert spread == pytest.approx(1.2) and cv < 0.1 and not bench.is_noisy(spread, cv)
    spread, cv = bench.timing_noise([1e-3, 1e-3, 2.5e-3])  # one slow loop: max/min 2.5
    assert spread == pytest.approx(2.5) and bench.is_noisy(spread, cv)
    assert bench.is_noisy(1.9, 0.6) and not bench.is_noisy(2.0, 0.5)  # CV alone; limits are exclusive
    # CV of [1, 1, 1, 1.95]: pstdev 0.411 / mean 1.2375 = 0.33, max/min 1.95 -> steady enough
    assert not bench.is_noisy(*bench.timing_noise([1.0, 1.0, 1.0, 1.95]))


def test_noise_warnings_name_op_and_size():
    steady = {"op": "all_gather", "mode": "blocking", "bytes": 4 * KiB, "loop_spread": 1.1, "loop_cv": 0.05}
    noisy = {"op": "all_reduce", "mode": "blocking", "bytes": 16 * MiB, "loop_spread": 3.0, "loop_cv": 0.6}
    plain = {"op": "all_reduce", "mode": "after_compute", "bytes": 16 * MiB}  # no loop times: skipped
    lines = bench.noise_warnings([steady, noisy, plain])
    assert len(lines) == 1
    assert "all_reduce (blocking) 16MiB" in lines[0] and "--iters" in lines[0] and "idle machine" in lines[0]
    assert "max/min 3.00" in lines[0] and "CV 0.60" in lines[0]


def test_single_process_run(tmp_path, capsys):
    """World size 1 in-process: all collectives except p2p run; busbw of all_reduce is 0."""
    out = tmp_path / "r.json"
    assert bench.main(["--sizes", "4KiB,8KiB", "--iters", "2", "--warmup", "1", "--json", str(out)]) == 0
    assert "p2p skipped" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["topology"]["world_size"] == 1 and data["topology"]["interconnect"] == CPU_INTERCONNECT
    assert {r["op"] for r in data["results"]} == set(bench.OPS) - {"p2p"}
    assert all(r["busbw_GBps"] == 0 for r in data["results"] if r["op"] == "all_reduce")
    assert all(r["loop_spread"] >= 1 and r["loop_cv"] >= 0 for r in data["results"] if r["mode"] != "after_compute")


def test_two_process_end_to_end(tmp_path):
    js, png = tmp_path / "comm.json", tmp_path / "comm.png"
    cmd = [sys.executable, "-m", "zerotron.bench.comm", "--nproc", "2", "--sizes", "4KiB:64KiB",
           "--iters", "3", "--warmup", "1", "--json", str(js), "--plot", str(png)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "busbw GB/s" in p.stdout and "hidden fraction" in p.stdout
    data = json.loads(js.read_text())
    sizes = [4 * KiB << i for i in range(5)]
    got = {(r["op"], r["mode"], r["bytes"]) for r in data["results"]}
    want = ({(op, "blocking", b) for op in bench.OPS for b in sizes}
            | {("all_reduce", m, b) for m in ("nonblocking", "after_compute") for b in sizes})
    assert got == want and len(data["results"]) == len(want)
    for r in data["results"]:
        assert r["time_s"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * busbw_factor(r["op"], 2), rel=1e-12)
    topo = data["topology"]
    assert topo["world_size"] == 2 and topo["backend"] == "gloo" and topo["device_type"] == "cpu"
    assert [r["rank"] for r in topo["ranks"]] == [0, 1] and len({r["pid"] for r in topo["ranks"]}) == 2
    ov = data["overlap"]
    assert 0.0 <= ov["hidden_fraction"] <= 1.0 and ov["allreduce_bytes"] == 64 * KiB
    assert all(ov[k] > 0 for k in ("t_matmul_s", "t_allreduce_s", "t_both_s")) and math.isfinite(ov["t_both_s"])
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
