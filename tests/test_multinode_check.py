"""The multi-node address check run before init_process_group (zerotron.multinode_check.check_multinode_addresses):
a loopback MASTER_ADDR or a gloo run whose hostname resolves to loopback is named in one line, and is
an error (exit 2) where the run certainly cannot connect."""
import socket

import pytest

from zerotron.multinode_check import check_multinode_addresses

TWO_NODES = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2", "GROUP_RANK": "1",
             "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def closed_port() -> socket.socket:
    """A socket bound to a loopback port and never listening: while it is open, connecting to that
    port is refused and no other process can listen there (a port merely closed again can be
    bound at once by a neighbour, e.g. the other pytest worker's TCPStore)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def test_one_node_or_no_torchrun_is_silent():
    assert check_multinode_addresses("gloo", {}) == ([], False)
    one = {**TWO_NODES, "GROUP_WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1"}
    assert check_multinode_addresses("gloo", one) == ([], False)


def test_loopback_master_addr_is_an_error_when_nothing_listens(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "10.255.255.1")  # not loopback: no gloo line
    with closed_port() as s:
        env = {**TWO_NODES, "MASTER_ADDR": "localhost", "MASTER_PORT": str(s.getsockname()[1])}
        lines, certain = check_multinode_addresses("gloo", env)
        assert len(lines) == 1 and "MASTER_ADDR=localhost" in lines[0] and "--local-addr" in lines[0]
        assert certain
        # on node 0, or before the store is up (workers host it), it is a warning only
        assert check_multinode_addresses("gloo", {**env, "GROUP_RANK": "0"})[1] is False
        assert check_multinode_addresses("gloo", {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"})[1] is False


def test_loopback_master_addr_with_a_listener_is_a_warning(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "10.255.255.1")
    with socket.socket() as s:  # two agents on one host: the store is reachable over loopback
        s.bind(("127.0.0.1", 0))
        s.listen()
        env = {**TWO_NODES, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.getsockname()[1])}
        lines, certain = check_multinode_addresses("gloo", env)
    assert len(lines) == 1 and not certain


@pytest.mark.parametrize("master, certain", [("10.255.255.1", True), ("127.0.0.1", False)])
def test_gloo_without_ifname_on_a_loopback_hostname(monkeypatch, master, certain):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    env = {**TWO_NODES, "MASTER_ADDR": master, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    lines, got = check_multinode_addresses("gloo", env)
    assert any("GLOO_SOCKET_IFNAME" in ln and "'localhost'" in ln for ln in lines)
    assert got is certain  # MASTER_ADDR on another host: its ranks cannot reach our 127.0.0.1
    assert not any("GLOO" in ln for ln in check_multinode_addresses("gloo", {**env, "GLOO_SOCKET_IFNAME": "eth0"})[0])
    assert not any("GLOO" in ln for ln in check_multinode_addresses("nccl", env)[0])


def test_harness_says_why_it_cannot_run(monkeypatch):
    """The two-node tests skip with this reason where namespaces cannot be made (here: not root)."""
    import os

    from zerotron import testing_netns

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert testing_netns.netns_unavailable() == "creating network namespaces needs root"
    assert testing_netns.main(["--", "train"]) == 2
