"""Record ``bench comm --topology`` across the two-node harness with a shaped link (root needed):
benchmarks/comm_two_nodes.{json,png,md} plus the veth byte counters.

Usage: ``python benchmarks/comm_two_nodes.py [--rate 200mbit] [--budget 150]`` (runs the harness, ~2
min), or ``--md-only`` to rewrite the markdown from the existing JSON files."""
import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPS = "all_reduce,all_gather,reduce_scatter"


def fs(b: int) -> str:
    for u, f in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= f and b % f == 0:
            return f"{b // f}{u}"
    return f"{b}B"


def markdown(d: dict, veth: dict, wall_s: float | None, noisy: int | None) -> str:
    """The report: command, scopes, node layout, the cliff table, busbw per scope and size."""
    rate = veth.get("rate")
    lines = [f"# bench comm across two nodes: the intra-/inter-node cliff (gloo, {rate} link)", "",
             "Two network namespaces joined by a veth pair (`zerotron/testing_netns.py`), the link shaped with",
             f"`tc qdisc ... tbf rate {rate} burst 256kb latency 200ms` in both directions (no delay: this",
             "kernel has no `sch_netem`), 2 gloo ranks per node, on the shared 2-core machine"
             + (f" ({noisy} of the {len(d['results'])} timings carry bench comm's noise warning)." if noisy is not None
                else "."), "",
             "```bash", f"python benchmarks/comm_two_nodes.py --rate {rate} --budget {d['config']['time_budget_s']:g}",
             f"# = python -m zerotron.testing_netns --rate {rate} -- bench comm --ops {','.join(d['config']['ops'])} \\",
             f"#     --time-budget {d['config']['time_budget_s']:g} --json ... --plot ...", "```", "",
             "Scopes (`zerotron/bench/comm_topo.py`): **intra** = the ranks of each node (all nodes at once, loopback",
             "TCP); **inter** = local rank j of every node (one group per local rank, all at once, sharing the link:",
             "HSDP's replicate groups); **world** = all ranks (a flat ring that crosses the link both ways).", "",
             "Nodes as the topology report names them (both namespaces share the hostname; torchrun's GROUP_RANK",
             "tells them apart):", ""]
    for n in d["topology"]["nodes"]:
        lines.append(f"- node {n['node']} ({n['hostname']}, {n['ifname']}): ranks {n['ranks']} = local ranks "
                     f"{n['local_ranks']}")
    sent = [a - b for a, b in zip(veth["after"]["tx"], veth["before"]["tx"])]
    lines += ["", (f"The sweep finished in {wall_s:.0f} s wall, startup included, " if wall_s else "The sweep finished ")
              + f"within its {d['config']['time_budget_s']:g} s budget; the budget left out the largest sizes of "
              f"{', '.join(d['truncated']) or 'none'}. Bytes sent through the veth: {sent[0] / 1e9:.2f} GB by node 0, "
              f"{sent[1] / 1e9:.2f} GB by node 1.", "", "## The cliff", "",
              "| op | size | intra-node busbw GB/s | inter-node busbw GB/s | ratio |", "|---|---|---|---|---|"]
    for c in d["cliff"]:
        lines.append(f"| {c['op']} | {fs(c['bytes'])} | {c['intra_busbw_GBps']:.3f} | {c['inter_busbw_GBps']:.4f} | "
                     f"{c['ratio']:.1f}× |")
    lines += ["", "Against the link: a 2-rank all-reduce sends S bytes per rank each way and the two inter groups",
              "share the link, so each gets at most half its rate; the flat 4-rank ring is bounded by the one link",
              "it crosses. gloo's reduce_scatter reaches half of all_gather's busbw on the same link (its algorithm",
              "moves more than a ring's (n-1)/n; not investigated further). Intra-node figures are loopback TCP on",
              "2 shared cores (CPU-bound, noisy), not NVLink; on GPU nodes run the same command under torchrun.", "",
              "## busbw by scope and size (GB/s)", "", "| op | size | intra | inter | world |", "|---|---|---|---|---|"]
    rows = defaultdict(dict)
    for r in d["results"]:
        rows[(r["op"], r["requested_bytes"])][r["scope"]] = r["busbw_GBps"]
    for (op, b), s in rows.items():
        cell = {k: f"{s[k]:.4f}" if k in s else "–" for k in ("intra", "inter", "world")}
        lines.append(f"| {op} | {fs(b)} | {cell['intra']} | {cell['inter']} | {cell['world']} |")
    lines += ["", "Plot: `benchmarks/comm_two_nodes.png` (solid intra, dashed inter, dotted world).", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--budget", type=float, default=150)
    p.add_argument("--md-only", action="store_true")
    a = p.parse_args()
    wall = noisy = None
    if not a.md_only:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "zerotron.testing_netns", "--rate", a.rate, "--timeout", "600",
                            "--bytes-json", str(HERE / "comm_two_nodes_veth.json"), "--", "bench", "comm", "--ops", OPS,
                            "--time-budget", str(a.budget), "--json", str(HERE / "comm_two_nodes.json"),
                            "--plot", str(HERE / "comm_two_nodes.png")], capture_output=True, text=True)
        wall = time.monotonic() - t0
        sys.stdout.write(r.stdout)
        noisy = r.stderr.count("noisy timing")
        if r.returncode != 0:
            sys.stderr.write(r.stderr[-5000:])
            return r.returncode
    d = json.loads((HERE / "comm_two_nodes.json").read_text())
    veth = json.loads((HERE / "comm_two_nodes_veth.json").read_text())
    (HERE / "comm_two_nodes.md").write_text(markdown(d, veth, wall, noisy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
