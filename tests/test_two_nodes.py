"""Two "nodes" (network namespaces joined by a veth pair, :mod:`zerotron.testing_netns`), 2 processes
each, under torchrun with a c10d rendezvous: the per-step losses equal a 1 x 4 run (its 4 workers on pooled ranks)
exactly (fp64), and a checkpoint the two nodes wrote, resumed on one node (one process: resharded
from dp 4 to 1), continues like the uninterrupted run (within 1e-12). Skips, saying why, where namespaces cannot be
created (not root, no iproute2)."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from zerotron.cli.main import main
from zerotron.testing import run_ranks_captured
from zerotron.testing_cli import run_cli
from zerotron.testing_netns import TwoNodes, netns_unavailable, remove_stale

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6
WHY = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two-node harness: {WHY}")


def train_args(run_dir, cache):
    return ["train", "--config", "configs/tiny.toml", "--run-dir", str(run_dir), "--train.steps", str(STEPS),
            "--train.dtype", "fp64", "--train.micro_batch", "2", "--checkpoint.every", "3",
            "--checkpoint.keep", "0", "--train.eval_every", "0", "--log.sample_tokens", "0",
            "--data.cache_dir", cache, "--log.progress", "false"]


def zerotron(*args):
    # a child of the fork server (`python -m zerotron ...` with torch already imported: ~3 s less each)
    r = run_cli(list(args), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, f"zerotron {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def losses(run_dir) -> dict:
    recs = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("two_nodes")
    # the 1 x 4 reference as its 4 workers run it, on the pooled ranks (4 fresh interpreters fewer)
    one = run_ranks_captured(main, 4, train_args(tmp / "one", data_cache), env={"OMP_NUM_THREADS": "1"},
                             join_timeout_s=300)
    assert [code for code, _, _ in one] == [0] * 4, one
    with TwoNodes() as nodes:
        before = nodes.link_bytes()
        results = nodes.torchrun(["-m", "zerotron", *train_args(tmp / "two", data_cache)], nproc_per_node=2,
                                 timeout_s=180, cwd=str(ROOT))
        after = nodes.link_bytes()
        names = [n.netns for n in nodes.nodes]
    for r in results:
        assert r.returncode == 0, f"node {r.node.index}: exit {r.returncode}\n{r.stdout}\n{r.stderr[-4000:]}"
        assert "zerotron: warning" not in r.stderr, r.stderr  # addresses and interface set: no complaint
    # resume on one node from the two nodes' step-3 checkpoint (as if the run had stopped there)
    shutil.copytree(tmp / "two", tmp / "resumed")
    shutil.rmtree(tmp / "resumed" / "checkpoints" / f"step_{STEPS}")
    resumed = zerotron(*train_args(tmp / "resumed", data_cache), "--resume")  # one process: cheapest on 2 cores
    return {"tmp": tmp, "bytes": (before, after), "names": names, "resumed": resumed}


def test_two_nodes_equal_one_node(runs):
    one, two = losses(runs["tmp"] / "one"), losses(runs["tmp"] / "two")
    assert list(two) == list(range(1, STEPS + 1))
    assert two == one  # exact: fp64, the same 4-rank reductions over veth as over loopback
    before, after = runs["bytes"]
    sent = [a - b for a, b in zip(after["tx"], before["tx"])]
    assert min(sent) > 1e6, sent  # the gradients crossed the link (~1.9 MB per step and direction)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in runs["names"])  # cleaned up


def test_resume_on_one_node_continues(runs):
    one, resumed = losses(runs["tmp"] / "one"), losses(runs["tmp"] / "resumed")
    assert "resum" in runs["resumed"].stderr + runs["resumed"].stdout
    assert list(resumed) == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):  # dp 1 instead of 4: the same sums in another order (fp64)
        assert resumed[step] == pytest.approx(one[step], rel=1e-12, abs=0), step


def test_cleanup_after_timeout():
    """A run that outlives its timeout is killed and both namespaces are gone afterwards."""
    with TwoNodes() as nodes:
        res = nodes.torchrun(["--no-python", "sleep", "60"], nproc_per_node=1, timeout_s=3)
        names = [n.netns for n in nodes.nodes]
    assert [r.returncode for r in res] == [None, None]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert remove_stale() == []
