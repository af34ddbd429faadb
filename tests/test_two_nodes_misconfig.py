"""What breaks without the multi-node settings, on the two-node harness (1 worker per node): without
``--local-addr`` MASTER_ADDR is loopback, without ``GLOO_SOCKET_IFNAME`` gloo advertises 127.0.0.1.
Either way torch alone hangs (node 0 until the collective timeout); zerotron's check makes node 1
fail within seconds with one line naming the setting (exit code 2 from its worker) and node 0
warn."""
from pathlib import Path

import pytest

from zerotron.testing_netns import TwoNodes, netns_unavailable

ROOT = Path(__file__).resolve().parent.parent
WHY = netns_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two-node harness: {WHY}")
ARGV = ["-m", "zerotron", "bench", "comm", "--ops", "all_reduce", "--sizes", "4KiB", "--iters", "3", "--timeout", "60"]


@pytest.mark.parametrize("missing, says", [
    ("local_addr", "has MASTER_ADDR=localhost, which resolves to 127.0.0.1 (loopback)"),
    ("ifname", "on gloo without GLOO_SOCKET_IFNAME: this host's name"),
])
def test_missing_setting_fails_fast_with_one_line(missing, says):
    with TwoNodes() as nodes:
        res = nodes.torchrun(ARGV, nproc_per_node=1, timeout_s=60, cwd=str(ROOT), fail_fast=True,
                             local_addr=missing != "local_addr", ifname=missing != "ifname")
    node0, node1 = res
    assert node1.returncode not in (None, 0), node1.stderr[-3000:]  # failed, before the 60 s timeout
    assert f"zerotron: error: a 2-node run (2 ranks) {says}" in node1.stderr
    assert "exitcode  : 2" in node1.stderr  # the worker's user-error exit code, in torchrun's summary
    assert f"zerotron: warning: a 2-node run (2 ranks) {says}" in node0.stderr
