"""Who runs where: a small report of the process group's hosts, devices and interconnect.

``topology_report()`` gathers one record per rank with ``all_gather_object`` (control plane, no
tensor traffic) and, on CUDA, attaches the output of ``nvidia-smi topo -m`` (run once per host, by
local rank 0, with a timeout) plus a one-word summary of the links it shows. On CPU the label is
``CPU_INTERCONNECT``; note that gloo's transport is TCP (over the loopback device when all ranks
share a host), not a shared-memory segment.

The legend of ``nvidia-smi topo -m``: ``NV#`` = a bonded set of # NVLinks (NVSwitch systems show
the same ``NV#`` between every pair); ``PIX``/``PXB``/``PHB``/``NODE``/``SYS`` = paths over PCIe
(and the CPU's host bridge / interconnect); ``X`` = self.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess

import torch
import torch.distributed as dist

from zerotron.distributed import comm

CPU_INTERCONNECT = "loopback TCP (gloo; no shared-memory transport)"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PCIE = {"PIX", "PXB", "PHB", "NODE", "SYS", "SOC"}


def summarize_topo(text: str | None) -> str:
    """One-line summary of an ``nvidia-smi topo -m`` matrix.

    Returns ``"NVLink/NVSwitch"`` if any GPU pair shows an ``NV#`` link, ``"PCIe"`` if pairs are
    only connected over PCIe/host paths (PIX, PXB, PHB, NODE, SYS), ``"single GPU"`` if the matrix
    has no GPU pairs, and ``"unknown"`` for empty/None input. Never raises."""
    if not text:
        return "unknown"
    rows = [ln.split() for ln in _ANSI.sub("", text).splitlines() if re.match(r"\s*GPU\d+\s", ln)]
    cells = {c for row in rows for c in row[1:]}
    if any(re.fullmatch(r"NV\d+", c) for c in cells):
        return "NVLink/NVSwitch"
    if cells & _PCIE:
        return "PCIe"
    return "single GPU" if rows else "unknown"


def nvidia_smi_topo(timeout_s: float = 10.0) -> str | None:
    """Text of ``nvidia-smi topo -m`` (ANSI colour codes removed), or None if the binary is absent.

    A failure (non-zero exit, timeout after ``timeout_s`` seconds, OS error) is returned as a
    string starting with ``"error: "`` rather than raised: a report must not abort a benchmark."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        p = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"error: {e}"
    if p.returncode != 0:
        return f"error: nvidia-smi exited {p.returncode}: {p.stderr.strip()[:500]}"
    return _ANSI.sub("", p.stdout)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _local_record(device: torch.device) -> dict:
    rec = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "hostname": socket.gethostname(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        "node_rank": int(os.environ.get("GROUP_RANK", -1)),  # torchrun's node index (-1: not set)
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME") or "",
        "pid": os.getpid(),
        "device": str(device),
        "device_name": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        rec["device_name"] = torch.cuda.get_device_name(device)
        if rec["local_rank"] == 0:
            rec["nvidia_smi_topo"] = nvidia_smi_topo()
    return rec


def topology_report(device: torch.device | str | None = None) -> dict:
    """Describe the current process group; collective over the default group (call on every rank).

    Returns a JSON-friendly dict: ``backend`` (``"gloo"``/``"nccl"``, None without a process
    group), ``world_size``, ``device_type``, ``hosts`` (sorted unique hostnames), ``ranks`` (one
    record per rank: rank, hostname, local_rank, local_world_size, node_rank, ifname, pid, device,
    device_name, cpu_count, torch_threads), ``nodes`` (:func:`node_layout`), ``interconnect`` (summary string) and, on CUDA,
    ``nvidia_smi_topo`` ({hostname: text or None}). Works without an initialised process group
    (world size 1, nothing gathered)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    local = _local_record(device)
    ranks = comm.all_gather_object(local) if dist.is_initialized() else [local]
    hosts = sorted({r["hostname"] for r in ranks})
    nodes = node_layout(ranks)
    report = {
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "world_size": len(ranks),
        "device_type": device.type,
        "hosts": hosts,
        "ranks": [{k: v for k, v in r.items() if k != "nvidia_smi_topo"} for r in ranks],
        "nodes": nodes,
    }
    if device.type == "cuda":
        topo = {r["hostname"]: r.get("nvidia_smi_topo") for r in ranks if "nvidia_smi_topo" in r}
        report["nvidia_smi_topo"] = topo
        kinds = sorted({summarize_topo(t) for t in topo.values()}) or ["unknown"]
        report["interconnect"] = " + ".join(kinds)
    else:
        report["interconnect"] = CPU_INTERCONNECT
    if len(nodes) > 1:
        report["interconnect"] += f" within a node; network between {len(nodes)} nodes"
    return report


def node_layout(ranks: list[dict]) -> list[dict]:
    """Group per-rank records into nodes: ``[{"node", "hostname", "ifname", "ranks", "local_ranks"}]``
    sorted by node index. A node is torchrun's ``GROUP_RANK`` (``node_rank``) where every rank has
    one, else a hostname (node indices in hostname order): two network namespaces on one machine
    share a hostname but not a GROUP_RANK."""
    by_group = all(r.get("node_rank", -1) >= 0 for r in ranks)
    names = sorted({r["hostname"] for r in ranks})
    nodes: dict[int, dict] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        k = r["node_rank"] if by_group else names.index(r["hostname"])
        n = nodes.setdefault(k, {"node": k, "hostname": r["hostname"], "ifname": r.get("ifname", ""),
                                 "ranks": [], "local_ranks": []})
        n["ranks"].append(r["rank"])
        n["local_ranks"].append(r["local_rank"])
    return [nodes[k] for k in sorted(nodes)]


def format_nodes(nodes: list[dict]) -> str:
    """One line per node: ``node 0 (vm, zt0): ranks 0,1 = local ranks 0,1``."""
    out = []
    for n in nodes:
        where = n["hostname"] + (f", {n['ifname']}" if n.get("ifname") else "")
        out.append(f"node {n['node']} ({where}): ranks {','.join(map(str, n['ranks']))} = local ranks "
                   f"{','.join(map(str, n['local_ranks']))}")
    return "\n".join(out)
