"""Two "nodes" on one machine: two network namespaces joined by a veth pair (tests, benchmarks).

Each node is a network namespace with one end of a veth pair (``10.99.0.1`` on node 0, ``10.99.0.2``
on node 1; addresses and ports are private to the namespaces, so concurrent harnesses do not
collide). The inter-node link can be shaped with ``tc qdisc ... tbf rate R`` (``rate``) and, where the
kernel has ``sch_netem``, ``netem delay D`` (``delay``). :meth:`TwoNodes.torchrun` starts one
``torchrun`` per node with the settings a multi-node run needs (``--rdzv-backend c10d``,
``--rdzv-endpoint <node 0>:29400``, ``--local-addr <node ip>``, ``--rdzv-conf is_host=1`` on node 0,
``GLOO_SOCKET_IFNAME=<veth>``); without ``--local-addr`` MASTER_ADDR is the shared hostname, which
resolves to 127.0.0.1, and without ``GLOO_SOCKET_IFNAME`` gloo binds to loopback: both hang.

Everything is removed on exit (processes, namespaces, which takes the veths with them), also after
an exception or a timeout; namespaces left by a killed harness (its pid gone) are removed by the
next one. Needs Linux, root and ``ip`` (iproute2): :func:`netns_unavailable` says why not.

CLI: ``python -m zerotron.testing_netns [--rate 200mbit] [--delay 1ms] [--nproc-per-node 2]
[--timeout S] [--bytes-json F] -- <zerotron args>`` runs ``zerotron <args>`` across the two nodes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from .train.run_lock import pid_alive

PREFIX = "ztn"  # namespace names: ztn<pid>n<k>
SUBNET = "10.99.0"
PORT = 29400


@dataclass
class Node:
    """One "node": its index, network namespace, veth name inside it and address."""
    index: int
    netns: str
    ifname: str
    ip: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why two network namespaces cannot be made here (not Linux, not root, no ``ip``, ``ip netns
    add`` refused), or None when they can (checked by creating and deleting one)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands (iproute2) are not installed"
    probe = f"{PREFIX}{os.getpid()}probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"'ip netns add' failed: {r.stderr.strip() or r.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> list[str]:
    """Delete namespaces named ``ztn<pid>...`` whose creating process is gone; returns their names."""
    out = _ip("netns", "list", check=False).stdout.split("\n")
    gone = []
    for line in out:
        name = line.split(" ")[0]
        digits = name[len(PREFIX):].split("n")[0].removesuffix("probe")
        if name.startswith(PREFIX) and digits.isdigit() and not pid_alive(int(digits)):
            _kill_netns_pids(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _kill_netns_pids(netns: str) -> None:
    """SIGKILL every process left in our namespace ``netns`` (all started by this harness)."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for p in pids:
        try:
            os.kill(int(p), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class NodeResult:
    """What one node's torchrun left: exit code (None: killed at the timeout), stdout, stderr."""
    node: Node
    returncode: int | None
    stdout: str
    stderr: str


class TwoNodes:
    """Context manager: two namespaces joined by a veth pair; see the module docstring.

    ``rate`` (tc syntax, e.g. ``"200mbit"``) and ``delay`` (e.g. ``"1ms"``) shape both directions of
    the link. Raises RuntimeError with the failing command's message if setup fails (after cleaning
    up what it made)."""

    def __init__(self, rate: str | None = None, delay: str | None = None):
        self.rate, self.delay = rate, delay
        tag = f"{PREFIX}{os.getpid()}"
        self.nodes = [Node(k, f"{tag}n{k}", f"zt{k}", f"{SUBNET}.{k + 1}") for k in range(2)]
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> TwoNodes:
        remove_stale()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, *args: str) -> None:
        r = subprocess.run(args, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"two-node harness: '{' '.join(args)}' failed: {r.stderr.strip()}")

    def _setup(self) -> None:
        a, b = self.nodes
        for n in self.nodes:
            self._run("ip", "netns", "add", n.netns)
        self._run("ip", "link", "add", a.ifname, "netns", a.netns, "type", "veth", "peer", "name", b.ifname,
                  "netns", b.netns)
        for n in self.nodes:
            self._run("ip", "-n", n.netns, "addr", "add", f"{n.ip}/24", "dev", n.ifname)
            self._run("ip", "-n", n.netns, "link", "set", n.ifname, "up")
            self._run("ip", "-n", n.netns, "link", "set", "lo", "up")
            if self.delay:  # netem does both delay and rate
                self._run("ip", "netns", "exec", n.netns, "tc", "qdisc", "add", "dev", n.ifname, "root", "netem",
                          "delay", self.delay, *(["rate", self.rate] if self.rate else []), "limit", "100000")
            elif self.rate:
                self._run("ip", "netns", "exec", n.netns, "tc", "qdisc", "add", "dev", n.ifname, "root", "tbf",
                          "rate", self.rate, "burst", "256kb", "latency", "200ms")

    def exec_argv(self, node: Node, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace (``ip netns exec``)."""
        return ["ip", "netns", "exec", node.netns, *argv]

    def torchrun_argv(self, node: Node, nproc_per_node: int, module_argv: list[str],
                      local_addr: bool = True) -> list[str]:
        """The torchrun command line of ``node``: ``module_argv`` (e.g. ``["-m", "zerotron", "train",
        ...]``) on ``nproc_per_node`` workers, rendezvous at node 0 (``local_addr=False`` leaves out
        ``--local-addr``, to show the hang it prevents)."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.nodes[0].ip}:{PORT}", "--rdzv-id", self.nodes[0].netns,
                *(["--local-addr", node.ip] if local_addr else []),
                *(["--rdzv-conf", "is_host=1"] if node.index == 0 else []), *module_argv]

    def node_env(self, node: Node, ifname: bool = True) -> dict:
        """The environment of ``node``'s torchrun: ours plus ``GLOO_SOCKET_IFNAME`` (unless not
        ``ifname``) and one OpenMP thread per worker unless set."""
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = node.ifname
        else:
            env.pop("GLOO_SOCKET_IFNAME", None)
        return env

    def torchrun(self, module_argv: list[str], nproc_per_node: int = 2, timeout_s: float = 300,
                 cwd: str | None = None, local_addr: bool = True, ifname: bool = True,
                 fail_fast: bool = False) -> list[NodeResult]:
        """Run ``module_argv`` under torchrun on both nodes at once and wait for both, at most
        ``timeout_s`` seconds (or, with ``fail_fast``, until one node fails); then the processes
        still running are killed and their returncode is None. ``local_addr`` / ``ifname`` False
        leave out ``--local-addr`` / ``GLOO_SOCKET_IFNAME`` (to show what they prevent)."""
        procs, files = [], []
        for n in self.nodes:
            argv = self.exec_argv(n, self.torchrun_argv(n, nproc_per_node, module_argv, local_addr))
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(subprocess.Popen(argv, cwd=cwd, env=self.node_env(n, ifname), stdout=out, stderr=err,
                                          text=True, start_new_session=True))
            self._procs.append(procs[-1])
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if time.monotonic() > deadline or (fail_fast and any(c not in (None, 0) for c in codes)):
                self._kill_all()
                break
            time.sleep(0.1)
        results = []
        for n, p, c, (out, err) in zip(self.nodes, procs, codes, files):
            p.wait()
            texts = []
            for f in (out, err):
                f.seek(0)
                texts.append(f.read())
                f.close()
            results.append(NodeResult(n, c, *texts))
        return results

    def link_bytes(self) -> dict:
        """``{"tx": [node0, node1], "rx": [...]}``: bytes through each node's veth so far."""
        out = {}
        for key in ("tx", "rx"):
            out[key] = [int(subprocess.run(self.exec_argv(n, ["cat", f"/sys/class/net/{n.ifname}/statistics/"
                                                           f"{key}_bytes"]), capture_output=True, text=True,
                                           check=True).stdout) for n in self.nodes]
        return out

    def _kill_all(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for n in self.nodes:
            _kill_netns_pids(n.netns)

    def close(self) -> None:
        """Kill what is still running and delete both namespaces (idempotent)."""
        self._kill_all()
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for n in self.nodes:
            _ip("netns", "del", n.netns, check=False)


def main(argv: list[str] | None = None) -> int:
    """``python -m zerotron.testing_netns [options] -- <zerotron args>``; returns the worst exit code
    (2 with one line when namespaces are unavailable or arguments are bad, 124 on timeout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(prog="python -m zerotron.testing_netns",
                                description="Run 'zerotron <args>' under torchrun on two network-namespace nodes.")
    p.add_argument("--rate", help="shape the link: tc rate, e.g. 200mbit")
    p.add_argument("--delay", help="netem delay, e.g. 1ms (needs sch_netem)")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--bytes-json", help="write the veth byte counters before/after here")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if not rest:
        print("zerotron.testing_netns: error: give the zerotron arguments after --", file=sys.stderr)
        return 2
    why = netns_unavailable()
    if why:
        print(f"zerotron.testing_netns: error: {why}", file=sys.stderr)
        return 2
    try:
        with TwoNodes(args.rate, args.delay) as nodes:
            before = nodes.link_bytes()
            results = nodes.torchrun(["-m", "zerotron", *rest], args.nproc_per_node, args.timeout, cwd=os.getcwd())
            after = nodes.link_bytes()
    except RuntimeError as e:
        print(f"zerotron.testing_netns: error: {e}", file=sys.stderr)
        return 2
    for r in results:
        print(f"--- node {r.node.index} ({r.node.ip}, {r.node.ifname}): exit {r.returncode}")
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
    if args.bytes_json:
        with open(args.bytes_json, "w") as f:
            json.dump({"before": before, "after": after, "rate": args.rate, "delay": args.delay}, f, indent=2)
    codes = [124 if r.returncode is None else r.returncode for r in results]
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
