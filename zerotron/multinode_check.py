"""The address check a multi-node torchrun worker makes before ``init_process_group``
(:func:`check_multinode_addresses`, called by ``distributed.mesh.init_distributed``): a loopback
MASTER_ADDR or a gloo host name resolving to loopback, which would hang the rendezvous.
"""
from __future__ import annotations

import ipaddress
import os
import socket


def _resolve(host: str) -> list[str]:

    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return []


def _is_loopback(addrs: list[str]) -> bool:

    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def _bindable(addr: str) -> bool:
    """True when ``addr`` belongs to this host (a socket can bind to it)."""

    try:
        with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _refused(host: str, port: int) -> bool:

    try:
        socket.create_connection((host, port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def check_multinode_addresses(backend: str, env=None) -> tuple[list[str], bool]:
    """Problems of a multi-node torchrun worker's addresses, as ``(lines, certain)``; ``([], False)``
    outside torchrun or on one node (``GROUP_WORLD_SIZE`` <= 1, or all ranks local).

    A line for: MASTER_ADDR resolving to a loopback address (torchrun without ``--local-addr`` sets
    it to the hostname, which /etc/hosts often maps to 127.0.0.1: ranks on other nodes cannot reach
    it), and, for gloo without ``GLOO_SOCKET_IFNAME``, this host's name resolving to loopback (gloo
    then binds to 127.0.0.1 and tells its peers that address). ``certain`` is True when the run
    cannot work: nothing on this host listens at a loopback MASTER_ADDR:MASTER_PORT although the
    agent's store is already up (``TORCHELASTIC_USE_AGENT_STORE``), or gloo would advertise loopback
    while MASTER_ADDR is another host's address."""

    env = os.environ if env is None else env
    world, local = int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))
    if "MASTER_ADDR" not in env or int(env.get("GROUP_WORLD_SIZE", 1)) <= 1 or world <= local:
        return [], False
    nodes = int(env.get("GROUP_WORLD_SIZE", 1))
    master, port = env["MASTER_ADDR"], int(env.get("MASTER_PORT", 0) or 0)
    where = f"a {nodes}-node run ({world} ranks)"
    lines, certain = [], False
    maddrs = _resolve(master)
    if _is_loopback(maddrs):
        lines.append(f"{where} has MASTER_ADDR={master}, which resolves to {maddrs[0]} (loopback): ranks on "
                     "other nodes cannot reach it; pass torchrun --local-addr <this node's address> on every "
                     "node (and --rdzv-conf is_host=1 on the rendezvous host)")
        certain = (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("GROUP_RANK", "0") != "0"
                   and port > 0 and _refused(master, port))
    if backend == "gloo" and not env.get("GLOO_SOCKET_IFNAME"):
        host = socket.gethostname()
        haddrs = _resolve(host)
        if _is_loopback(haddrs):
            lines.append(f"{where} on gloo without GLOO_SOCKET_IFNAME: this host's name {host!r} resolves to "
                         f"{haddrs[0]} (loopback), so gloo would give its peers that address; set "
                         "GLOO_SOCKET_IFNAME=<the interface that reaches the other nodes> (see 'ip -br addr')")
            certain = certain or (bool(maddrs) and not _is_loopback(maddrs) and not any(map(_bindable, maddrs)))
    return lines, certain
