"""bench comm --topology helpers (zerotron.bench.comm_topo, topology.node_layout) on known inputs, and
one 2-process run on one node (intra scope only)."""
import json
import os
from pathlib import Path

import pytest

from zerotron.bench.comm_topo import _plan_calls, cliff, format_topology_table, scope_groups
from zerotron.bench.topology import format_nodes, node_layout
from zerotron.testing_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent


def rec(rank, host, local, node=-1):
    return {"rank": rank, "hostname": host, "local_rank": local, "node_rank": node, "ifname": ""}


def test_node_layout_by_group_rank_then_hostname():
    # two namespaces on one machine: one hostname, torchrun's GROUP_RANK tells the nodes apart
    same_host = [rec(0, "vm", 0, 0), rec(1, "vm", 1, 0), rec(2, "vm", 0, 1), rec(3, "vm", 1, 1)]
    nodes = node_layout(same_host)
    assert [(n["node"], n["ranks"], n["local_ranks"]) for n in nodes] == [(0, [0, 1], [0, 1]), (1, [2, 3], [0, 1])]
    by_host = node_layout([rec(0, "b", 0), rec(1, "a", 0), rec(2, "b", 1), rec(3, "a", 1)])
    assert [(n["hostname"], n["ranks"]) for n in by_host] == [("a", [1, 3]), ("b", [0, 2])]
    assert format_nodes(nodes).splitlines()[1] == "node 1 (vm): ranks 2,3 = local ranks 0,1"


def test_scope_groups():
    two = [{"ranks": [0, 1, 2, 3]}, {"ranks": [4, 5, 6, 7]}]
    assert scope_groups(two) == {"intra": [[0, 1, 2, 3], [4, 5, 6, 7]], "inter": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                 "world": [list(range(8))]}
    assert scope_groups([{"ranks": [0, 1]}]) == {"intra": [[0, 1]]}          # one node: world = intra
    assert scope_groups([{"ranks": [0]}, {"ranks": [1]}]) == {"inter": [[0, 1]], "world": [[0, 1]]}
    assert "inter" not in scope_groups([{"ranks": [0, 1]}, {"ranks": [2]}])  # unequal nodes


def test_plan_calls_fits_the_share():
    assert _plan_calls(None, 10.0, 20, 5) == (20, 5)      # first size: as asked
    assert _plan_calls(1e-3, 10.0, 20, 5) == (20, 5)      # fits easily
    assert _plan_calls(0.5, 4.0, 20, 5) == (7, 1)         # slow: warmup 1, 8 calls in 4 s
    assert _plan_calls(2.0, 5.0, 20, 5) is None           # 3 calls + 1 warmup do not fit
    k, w = _plan_calls(0.02, 1.0, 100, 5)
    assert (k + w) * 0.02 <= 1.0 and k >= 3


def test_cliff_and_table():
    rs = [{"scope": s, "op": "all_reduce", "requested_bytes": b, "bytes": b, "busbw_GBps": bw, "algbw_GBps": bw,
           "time_s": 1e-3, "groups": 2, "group_size": 2}
          for s, b, bw in (("intra", 1 << 20, 1.0), ("intra", 2 << 20, 1.2), ("inter", 1 << 20, 0.02))]
    c = cliff(rs)
    assert c == [{"op": "all_reduce", "bytes": 1 << 20, "intra_busbw_GBps": 1.0, "inter_busbw_GBps": 0.02,
                  "ratio": pytest.approx(50.0)}]
    text = format_topology_table({"results": rs, "cliff": c, "truncated": ["inter/all_reduce"]})
    assert "cliff all_reduce at 1MiB" in text and "50.0x" in text and "inter/all_reduce" in text


def test_one_node_topology_run(tmp_path):
    out = tmp_path / "t.json"
    r = run_cli(["bench", "comm", "--nproc", "2", "--topology", "on",  # fork-server child
                 "--ops", "all_reduce,reduce_scatter", "--sizes", "4KiB:16KiB", "--iters", "3",
                 "--warmup", "1", "--json", str(out)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                timeout=200)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["groups"] == {"intra": [[0, 1]]}
    assert {(x["scope"], x["op"], x["group_size"]) for x in data["results"]} == {
        ("intra", "all_reduce", 2), ("intra", "reduce_scatter", 2)}
    assert len(data["results"]) == 6 and data["truncated"] == [] and data["cliff"] == []
    assert "node 0 (" in r.stdout and "local ranks 0,1" in r.stdout


def test_calibrate_takes_both_links_from_a_topology_run():
    """`zerotron plan --calibrate` on the two-node run: intra results -> the intra-node link, inter
    results -> the inter-node link (12 MB/s per group on the shared 200 Mbit/s link), world ignored."""
    from zerotron.analysis.hardware import calibrate, hardware

    bench = json.loads((ROOT / "benchmarks" / "comm_two_nodes.json").read_text())
    base = hardware("h100")
    hw = calibrate(base, bench)
    assert 5e6 < hw.inter["all_reduce"] < 20e6 and 5e6 < hw.inter["all_gather"] < 20e6
    assert hw.intra["all_reduce"] > 10 * hw.inter["all_reduce"]
    intra_only = calibrate(base, {**bench, "results": [r for r in bench["results"] if r["scope"] == "intra"]})
    assert intra_only.intra == hw.intra and intra_only.inter == base.inter
