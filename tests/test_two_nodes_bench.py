"""``bench comm`` across the two-node harness with a 200 Mbit/s link: the topology report names both
nodes and their local ranks, busbw comes per scope (intra-node, inter-node, world), the inter-node
busbw is below the link rate and far below intra-node (the cliff), and the time budget ends the
sweep early instead of running for minutes."""
import json
import time
from pathlib import Path

import pytest

from zerotron.testing_netns import TwoNodes, netns_unavailable

ROOT = Path(__file__).resolve().parent.parent
WHY = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two-node harness: {WHY}")
BUDGET_S = 8


def test_bench_comm_topology_across_two_nodes(tmp_path):
    out = tmp_path / "comm.json"
    with TwoNodes(rate="200mbit") as nodes:
        t0 = time.monotonic()
        res = nodes.torchrun(["-m", "zerotron", "bench", "comm", "--ops", "all_reduce", "--sizes", "64KiB:16MiB",
                              "--iters", "6", "--warmup", "1", "--time-budget", str(BUDGET_S), "--json", str(out)],
                             nproc_per_node=2, timeout_s=150, cwd=str(ROOT))
        wall = time.monotonic() - t0
    for r in res:
        assert r.returncode == 0, f"node {r.node.index}: {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    data = json.loads(out.read_text())
    nodes_seen = [(n["node"], n["ranks"], n["local_ranks"], n["ifname"]) for n in data["topology"]["nodes"]]
    assert nodes_seen == [(0, [0, 1], [0, 1], "zt0"), (1, [2, 3], [0, 1], "zt1")]
    assert data["groups"] == {"intra": [[0, 1], [2, 3]], "inter": [[0, 2], [1, 3]], "world": [[0, 1, 2, 3]]}
    assert {x["scope"] for x in data["results"]} == {"intra", "inter", "world"}
    # 16 MiB all-reduces across 25 MB/s do not fit 8/3 s: the sweep stops early, the run stays short
    assert "inter/all_reduce" in data["truncated"]
    assert wall < BUDGET_S + 60, wall
    inter = [x["busbw_GBps"] for x in data["results"] if x["scope"] == "inter"]
    assert max(inter) < 0.2e9 / 8 / 1e9 * 1.5  # each group below the 25 MB/s link (two share it; tbf bursts)
    (c,) = data["cliff"]
    assert c["op"] == "all_reduce" and c["ratio"] > 2, c
