"""``zerotron bench comm --topology``: busbw inside a node vs across nodes (the cliff), on a time budget.

Groups (from :func:`zerotron.bench.topology.node_layout`, nodes of equal size L):

- ``intra``: the L ranks of each node, all nodes at once (what ZeRO/FSDP inside a node runs);
- ``inter``: the j-th rank of every node, for j = 0..L-1 at once (one rank per node per group, the
  replicate groups of HSDP: every rank's traffic crosses the network, L groups share the link);
- ``world``: all ranks (a flat layout; its ring crosses the node boundary twice).

Each (scope, op) sweeps the sizes upwards nccl-tests style (:func:`zerotron.bench.timing._loop_times`:
3 loops of back-to-back calls after a warmup, median loop, max over ranks), busbw = algbw x
``busbw_factor(op, group size)``. Time budget: each (scope, op) sweep gets an equal share of
``budget_s``; before a size, the time per call is predicted from the previous size (linear in bytes,
the max over ranks) and the calls are cut so that the size fits its share of the time left (in
proportion to its bytes among the sizes still to run, at least an equal split; at least 3 timed
calls, warmup 1 once a call takes > 50 ms); a size predicted not to fit ends the sweep (the result
says ``truncated``). Every rank takes the same decisions (from the gathered times).
The cliff: for each op, the ratio intra / inter busbw at the largest size both scopes reached.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from zerotron.bench.timing import _loop_times, _sync, actual_bytes, bandwidths, format_size, timing_noise
from zerotron.distributed import comm
from zerotron.out_files import out_path, write_out_file

SCOPES = ("intra", "inter", "world")
TOPO_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_TAG = "bench"


def scope_groups(nodes: list[dict]) -> dict[str, list[list[int]]]:
    """``{scope: [ranks of each group]}`` for the nodes of :func:`node_layout`; scopes whose groups
    would have one rank are left out (inter on one node, intra with one rank per node), inter
    needs nodes of equal size, and world is left out on one node (it is the intra group there). Pure
    function (no process group)."""
    sizes = {len(n["ranks"]) for n in nodes}
    out = {}
    if max(sizes) > 1:
        out["intra"] = [sorted(n["ranks"]) for n in nodes]
    if len(nodes) > 1 and len(sizes) == 1:
        out["inter"] = [[sorted(n["ranks"])[j] for n in nodes] for j in range(sizes.pop())]
    if len(nodes) > 1 or "intra" not in out:  # on one node, world is the intra group
        out["world"] = [sorted(r for n in nodes for r in n["ranks"])]
    return out


def make_groups(groups: dict[str, list[list[int]]]) -> dict[str, tuple[comm.NamedGroup, list[int]]]:
    """This rank's ``{scope: (group, its ranks)}``; collective: every rank creates every group (in the
    same order), as ``dist.new_group`` requires."""
    mine, me = {}, dist.get_rank()
    for scope, lists in groups.items():
        for ranks in lists:
            pg = dist.group.WORLD if len(ranks) == dist.get_world_size() else comm.new_group(ranks)
            if me in ranks:
                mine[scope] = (comm.NamedGroup(pg, scope), ranks)
    return mine


def _setup(op: str, nbytes: int, group: comm.NamedGroup, ranks: list[int], dev):
    """``(run, check)`` for ``op`` on ``group`` (as ``zerotron.bench.comm._setup`` on the world)."""
    n, r = len(ranks), ranks.index(dist.get_rank())
    k = nbytes // 4
    m = k // n

    def ar(count, start=0.0):
        return torch.arange(count, dtype=torch.float32, device=dev) + start

    if op == "all_reduce":
        t = ar(k, r)
        return (lambda: comm.all_reduce(t, group=group, tag=_TAG)), (lambda: torch.equal(t, ar(k) * n + n * (n - 1) / 2))
    if op == "broadcast":
        t = ar(k, r)
        return (lambda: comm.broadcast(t, src=ranks[0], group=group, tag=_TAG)), (lambda: torch.equal(t, ar(k)))
    if op == "all_gather":
        inp, out = ar(m, r * m), torch.empty(k, device=dev)
        return (lambda: comm.all_gather(out, inp, group=group, tag=_TAG)), (lambda: torch.equal(out, ar(k)))
    if op == "reduce_scatter":
        inp, out = ar(n * m), torch.empty(m, device=dev)
        return ((lambda: comm.reduce_scatter(out, inp, group=group, tag=_TAG)),
                (lambda: torch.equal(out, ar(m, r * m) * n)))
    raise ValueError(f"--topology measures {', '.join(TOPO_OPS)}; got {op!r}")


def _plan_calls(pred_s: float | None, share_s: float, iters: int, warmup: int) -> tuple[int, int] | None:
    """``(timed calls, warmup)`` for one size given the predicted seconds per call and the seconds
    this size may take, or None when even 3 calls (and 1 warmup) do not fit."""
    if pred_s is None:
        return iters, warmup
    w = warmup if pred_s < 0.05 else min(warmup, 1)
    k = min(iters, int(share_s / pred_s) - w)
    return (k, w) if k >= 3 else None


def sweep(op: str, scope: str, group, ranks: list[int], sizes: list[int], iters: int, warmup: int,
          dev, budget_s: float) -> tuple[list[dict], bool]:
    """Time ``op`` on every rank's ``scope`` group (all groups of the scope at once) over ``sizes``
    within ``budget_s`` seconds (module docstring); collective over the world. Returns the results
    (identical on all ranks) and whether sizes were left out. Raises RuntimeError on wrong values."""
    n = len(ranks)
    run, check = _setup(op, actual_bytes(min(sizes[0], 64 << 10), n), group, ranks, dev)
    run()
    _sync(dev)
    if not all(comm.all_gather_object(bool(check()))):
        raise RuntimeError(f"bench comm: {op} on the {scope} groups gave wrong values")
    out, t0, prev = [], time.perf_counter(), None
    for i, req in enumerate(sizes):
        nb = actual_bytes(req, n)
        pred = prev[1] * nb / prev[0] if prev else None
        left = budget_s - (time.perf_counter() - t0)
        rest = [actual_bytes(q, n) for q in sizes[i:]]
        share = max(left * nb / sum(rest), left / len(rest))  # ~ bytes, and no less than an equal split
        plan = _plan_calls(pred, share, iters, warmup)
        plan = comm.broadcast_object(plan, src=0)  # rank 0's clock decides for everyone
        if plan is None:
            return out, True
        k, w = plan
        run, _ = _setup(op, nb, group, ranks, dev)
        ts = _loop_times(run, k, w, dev)
        t_med = statistics.median(ts)
        everyone = comm.all_gather_object((t_med, timing_noise(ts)))
        t = max(e[0] for e in everyone)
        algbw, busbw = bandwidths(op, nb, t, n)
        out.append({"scope": scope, "group_size": n, "groups": dist.get_world_size() // n, "op": op,
                    "mode": "blocking", "bytes": nb, "requested_bytes": req, "time_s": t, "calls": 3 * max(1, k // 3),
                    "algbw_GBps": algbw, "busbw_GBps": busbw, "loop_spread": max(e[1][0] for e in everyone),
                    "loop_cv": max(e[1][1] for e in everyone)})
        prev = (nb, t)
    return out, False


def run_topology(ops, sizes, iters: int, warmup: int, dev, nodes: list[dict], budget_s: float) -> dict:
    """Sweep every op on every scope of :func:`scope_groups` (collective); returns ``{"groups",
    "results", "truncated" ([scope/op, ...]), "cliff"}``, identical on all ranks."""
    groups = scope_groups(nodes)
    mine = make_groups(groups)
    ops = [o for o in ops if o in TOPO_OPS]
    share = budget_s / max(1, len(ops) * len(groups))
    results, truncated = [], []
    for scope in (s for s in SCOPES if s in groups):
        g, ranks = mine[scope]
        for op in ops:
            rs, cut = sweep(op, scope, g, ranks, sizes, iters, warmup, dev, share)
            results += rs
            if cut:
                truncated.append(f"{scope}/{op}")
    return {"groups": groups, "results": results, "truncated": truncated, "cliff": cliff(results)}


def cliff(results: list[dict]) -> list[dict]:
    """Per op: intra and inter busbw at the largest (requested) size both scopes measured, and the
    ratio intra / inter."""
    out = []
    for op in dict.fromkeys(r["op"] for r in results):
        by = {s: {r["requested_bytes"]: r for r in results if r["op"] == op and r["scope"] == s}
              for s in ("intra", "inter")}
        common = sorted(set(by["intra"]) & set(by["inter"]))
        if common:
            a, b = by["intra"][common[-1]], by["inter"][common[-1]]
            out.append({"op": op, "bytes": common[-1], "intra_busbw_GBps": a["busbw_GBps"],
                        "inter_busbw_GBps": b["busbw_GBps"],
                        "ratio": a["busbw_GBps"] / b["busbw_GBps"] if b["busbw_GBps"] > 0 else float("inf")})
    return out


def format_topology_table(res: dict) -> str:
    """Table: scope, group size x groups, op, size, time (us), algbw, busbw; then the cliff lines."""
    lines = [f"{'scope':<7}{'groups':>8}  {'op':<15}{'size':>9}{'time us':>13}{'algbw GB/s':>12}{'busbw GB/s':>12}"]
    for r in res["results"]:
        lines.append(f"{r['scope']:<7}{str(r['groups']) + 'x' + str(r['group_size']):>8}  {r['op']:<15}"
                     f"{format_size(r['bytes']):>9}{r['time_s'] * 1e6:>13.1f}{r['algbw_GBps']:>12.4f}"
                     f"{r['busbw_GBps']:>12.4f}")
    for c in res["cliff"]:
        lines.append(f"cliff {c['op']} at {format_size(c['bytes'])}: intra-node busbw {c['intra_busbw_GBps']:.4f} "
                     f"GB/s vs inter-node {c['inter_busbw_GBps']:.4f} GB/s = {c['ratio']:.1f}x")
    if res["truncated"]:
        lines.append(f"time budget: larger sizes left out for {', '.join(res['truncated'])}")
    return "\n".join(lines)


def plot_topology(res: dict, path: str, title: str = "") -> None:
    """PNG of busbw vs size: one colour per op, solid intra / dashed inter / dotted world."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    colours = {op: f"C{i}" for i, op in enumerate(dict.fromkeys(r["op"] for r in res["results"]))}
    for scope, style in (("intra", "-"), ("inter", "--"), ("world", ":")):
        for op, c in colours.items():
            rs = [r for r in res["results"] if r["scope"] == scope and r["op"] == op]
            if rs:
                ax.plot([r["bytes"] for r in rs], [r["busbw_GBps"] for r in rs], marker="o", color=c,
                        linestyle=style, label=f"{op} {scope} ({rs[0]['groups']}x{rs[0]['group_size']})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v)) if v >= 1 else ""))
    ax.set_xlabel("size (bytes, nccl-tests convention)")
    ax.set_ylabel("busbw (GB/s, log)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.savefig(out_path(path), dpi=110, bbox_inches="tight")

def report_topology(args, ops, sizes, topo: dict, res: dict, noise_warnings) -> None:
    """Rank 0's output of a ``--topology`` run (``args``: bench comm's): nodes, the per-scope table and
    cliff, ``noise_warnings(results)`` lines on stderr, the JSON and the plot."""
    from zerotron.bench.topology import format_nodes

    print(f"zerotron bench comm --topology: {topo['backend']} on {topo['world_size']} rank(s), "
          f"{len(topo['nodes'])} node(s), {topo['interconnect']}; time budget {args.time_budget:g} s")
    print(format_nodes(topo["nodes"]))
    print(format_topology_table(res))
    for line in noise_warnings(res["results"]):
        print(f"zerotron bench comm: {line}", file=sys.stderr)
    if args.json:
        write_out_file(args.json, json.dumps({"topology": topo, **res, "config": {
            "ops": ops, "sizes": sizes, "iters": args.iters, "warmup": args.warmup,
            "time_budget_s": args.time_budget}}, indent=2))
    if args.plot:
        plot_topology(res, args.plot, f"busbw by scope: {topo['backend']}, {topo['world_size']} ranks on "
                      f"{len(topo['nodes'])} node(s)")
