"""Tests for ``zerotron bench context`` (zerotron/bench/context.py): the sequence-length sweep of
context parallelism, kept tiny (seq 64, 1 round, 1 step): rows per length and layout, the ring's
hidden transfer fraction and the zigzag/contiguous balance."""
import json
import os
from pathlib import Path

import pytest

from zerotron.bench import context as bc
from zerotron.testing_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.toml"


@pytest.mark.parametrize("args", [["--seq", "0"], ["--seq", "a,b"], ["--nproc", "1"], ["--layouts", "nope"],
                                  ["--repeats", "0"], ["--bogus"]])
def test_bad_arguments_exit_2(args, capsys):
    assert bc.main(["--config", str(TINY), *args]) == 2


def test_sweep_end_to_end(tmp_path, data_cache):
    js = tmp_path / "c.json"
    cmd = ["bench", "context", "--nproc", "2", "--config", str(TINY), "--seq", "64", "--layouts", "cp-ring,dp",
           "--steps", "1", "--warmup", "0", "--rounds", "1", "--repeats", "1", "--balance", "--json", str(js),
           "--log.progress", "false", "--data.cache_dir", data_cache]
    p = run_cli(cmd, timeout=300, cwd=ROOT, env={**os.environ})
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(js.read_text())
    assert [(r["seq"], r["kind"], r["layout"]) for r in rows] == [
        (64, "train", "cp-ring"), (64, "train", "dp"), (64, "ring", "ring-attention"), (64, "balance", "ring-attention")]
    ring_train, dp, ring, bal = rows
    assert ring_train["impl"] == "DataParallel x CP2 (ring)" and ring_train["tokens_per_step"] == dp["tokens_per_step"] == 8 * 64
    assert ring_train["ratio_vs_dp"] == pytest.approx(ring_train["tokens_per_s"] / dp["tokens_per_s"])
    assert ring_train["peak_mem_bytes"] > 0 and dp["tokens_per_s"] > 0
    assert 0 < ring_train["peak_above_floor_bytes"] < ring_train["peak_mem_bytes"]
    # the estimate: model states over dp x cp (DDP: replicated, 16 bytes per fp32 parameter with Adam)
    # + activations of seq / cp tokens; cp 2 holds half of dp 2's activations at the same micro-batch
    assert ring_train["estimate_states_bytes"] == dp["estimate_states_bytes"] == 16 * dp["num_params"]
    assert ring_train["estimate_activation_bytes"] * 2 == pytest.approx(dp["estimate_activation_bytes"], rel=0.05)
    # tiny.toml attention: micro_batch 4, 4 heads of 16; 3 cp - 2 = 4 hops timed alone
    assert (ring["cp"], ring["batch"], ring["heads"], ring["kv_heads"], ring["head_dim"]) == (2, 4, 4, 4, 16)
    assert ring["compute_s"] > 0 and ring["wait_s"] >= 0 and ring["transfer_s"] > 0
    assert ring["hidden_fraction_raw"] == min(1 - r["wait_s"] / r["transfer_s"] for r in ring["ranks"])
    # the waits split into the peers' lateness and exposed transfer; the hidden fraction counts only the latter
    for r in ring["ranks"]:
        assert r["exposed_s"] >= 0 and r["late_s"] >= 0 and r["exposed_s"] + r["late_s"] <= r["wait_s"] * 1.0001 + 1e-9
        assert r["hidden_fraction"] == 1 - r["exposed_s"] / r["transfer_s"] >= r["hidden_fraction_raw"]
    assert ring["hidden_fraction"] == min(r["hidden_fraction"] for r in ring["ranks"])
    # zigzag: equal score blocks per rank; contiguous at cp 2: the last rank computes twice the first's
    assert bal["zigzag"]["work_imbalance"] == 1.0 and bal["contiguous"]["work_imbalance"] == 2.0
    assert [r["rank"] for r in bal["zigzag"]["ranks"]] == [0, 1] and bal["zigzag"]["imbalance"] >= 1.0
    assert "hidden fraction" in p.stdout and "| 64 | cp-ring | DataParallel x CP2 (ring) |" in p.stdout


def test_exposed_transfer_sets_a_late_peer_apart():
    """bench.context.exposed_transfer: of each wait, the part before both peers of the hop posted
    it is lateness, the rest exposed transfer (3 ranks, hand-computed)."""
    from zerotron.bench.context import exposed_transfer

    ev = [{"posts": [0.0, 10.0], "waits": [(0, 1.0, 2.0), (1, 10.5, 11.0)]},  # rank 0
          {"posts": [1.5, 10.0], "waits": [(0, 1.6, 1.8), (1, 10.0, 10.1)]},  # rank 1: hop 0 posted late
          {"posts": [0.5, 12.0], "waits": [(0, 0.6, 2.0), (1, 12.0, 12.2)]}]  # rank 2: hop 1 posted late
    # rank 0, hop 0: prev = rank 2 posted 0.5, next = rank 1 posted 1.5 -> ready 1.5: late 0.5, exposed 0.5;
    # hop 1: ready max(10.5, 12.0, 10.0) = 12.0 > end 11.0 -> late 0.5, exposed 0
    assert exposed_transfer(ev, 0) == pytest.approx((0.5, 1.0))
    # rank 1, hop 0: ready max(1.6, 0.0, 0.5) = 1.6 -> exposed 0.2; hop 1: ready max(10.0, 10.0, 12.0) = 12 -> late 0.1
    assert exposed_transfer(ev, 1) == pytest.approx((0.2, 0.1))
    assert exposed_transfer([{"posts": [], "waits": []}], 0) == (0.0, 0.0)
