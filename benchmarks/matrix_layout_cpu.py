"""CPU seconds per layout per rank of the fp64 parity matrix on a fixed slice of layouts (issues 27, 28).

Runs a fixed, deterministic slice of the valid layouts (every ``--every``-th of those whose name
contains one of ``--names``, at world ``--world``) through ``parity.run_jobs`` on ``run_ranks``'
pooled ranks, as ``tests/test_parity_matrix.py`` does, after one warm-up layout that pays each
rank's imports; checks every layout against the single-process reference at ``parity.FP64_RTOL``
(the same ``parity.check``), and prints per rank the CPU seconds of the measured call
(``time.process_time``: every thread of the rank, gloo's included) divided by the number of
layouts. ``--profile DIR`` also writes a cProfile of every rank (``DIR/rank<r>.prof``).
The code measured is the ``zerotron`` on ``PYTHONPATH``: run the same script against two trees,
alternating, for a paired before/after on the same load.

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/matrix_layout_cpu.py --world 4 --names cp --every 50
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _threads() -> dict:
    """{thread id: (name, CPU seconds)} of this process's live threads (/proc/self/task)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                head, rest = f.read().rsplit(b")", 1)
        except OSError:
            continue
        fields = rest.split()
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                sw = sum(int(line.split()[1]) for line in f if line.endswith("ctxt_switches\n") or "ctxt_switches:" in line)
        except OSError:
            sw = 0
        out[tid] = (head.split(b"(", 1)[1].decode(), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), sw)
    return out


PHASES = (("zerotron.parity.runs", None, "train_layout", "train_layout"),
          ("zerotron.train.trainer", "Trainer", "__init__", "trainer_init"),
          ("zerotron.train.run_loop", None, "train_step", "train_step"),
          ("zerotron.train.run_loop", None, "evaluate", "evaluate"),
          ("zerotron.train.trainer", "Trainer", "fit", "fit"),
          ("zerotron.parity.runs", None, "_copies", "copies"),
          ("zerotron.parity.runs", None, "compare", "compare"),
          ("zerotron.parity.runs", None, "destroy_subgroups", "destroy_subgroups"))


def _time_phases() -> dict:
    """Wrap the functions of PHASES to sum this process's CPU seconds (all threads) spent in each;
    ``{"cpu": {phase: seconds}, "undo": callable}``. Nested phases count in both."""
    import importlib

    cpu, undo = {}, []
    for mod_name, cls, fn, phase in PHASES:
        owner = importlib.import_module(mod_name)
        owner = getattr(owner, cls) if cls else owner
        orig = getattr(owner, fn, None)
        if orig is None:
            continue

        def wrapped(*a, _orig=orig, _phase=phase, **k):
            c = time.process_time()
            try:
                return _orig(*a, **k)
            finally:
                cpu[_phase] = cpu.get(_phase, 0.0) + time.process_time() - c

        setattr(owner, fn, wrapped)
        undo.append((owner, fn, orig))
    return {"cpu": cpu, "undo": lambda: [setattr(o, f, g) for o, f, g in undo]}


def _rank_body(jobs, prof_dir):
    """One rank: run_jobs(jobs) with this process's CPU seconds (all threads) and wall seconds."""
    import cProfile

    import torch.distributed as dist

    from zerotron import parity
    from zerotron.parity import runs

    per_layout, train = {}, runs.train_layout

    def timed(layout, *args, **kw):  # CPU seconds of each layout's training (all threads of the process)
        c = time.process_time()
        try:
            return train(layout, *args, **kw)
        finally:
            per_layout[layout.name] = round(time.process_time() - c, 3)

    runs.train_layout = timed
    phases = _time_phases()
    pr = cProfile.Profile(time.thread_time) if prof_dir else None  # CPU of this (the main) thread
    th0 = _threads()
    c0, t0, w0 = time.process_time(), time.thread_time(), time.time()
    if pr:
        pr.enable()
    try:
        out = parity.run_jobs(jobs)
    finally:
        runs.train_layout = train
        phases["undo"]()
    if pr:
        pr.disable()
    cpu, main, wall = time.process_time() - c0, time.thread_time() - t0, time.time() - w0
    if pr:
        pr.dump_stats(os.path.join(prof_dir, f"rank{dist.get_rank()}.prof"))
    by_name: dict = {}  # CPU seconds and context switches of the call by thread name (ended threads not seen)
    for tid, (name, c, sw) in _threads().items():
        was = th0.get(tid, (name, 0.0, 0))
        by_name[name] = round(by_name.get(name, 0.0) + c - was[1], 2)
        by_name[name + "_switches"] = by_name.get(name + "_switches", 0) + sw - was[2]
    by_name["live_threads"] = len(os.listdir("/proc/self/task"))
    return out, cpu, wall, main, by_name, per_layout, phases["cpu"]


def _slice(names: list[str], world: int, every: int, offset: int, blocks: int, size: int):
    """Every ``every``-th candidate from ``offset`` (the valid ones), or, with ``blocks``, that many
    runs of ``size`` consecutive valid layouts evenly spread over the valid ones (a real run's
    chunks are consecutive layouts, which share mesh shapes)."""
    from zerotron import parity

    cands = [lay for lay in parity.all_layouts() if lay.world == world
             and (not names or any(n in lay.name for n in names))]
    if not blocks:
        return [lay for lay in cands[offset::every] if parity.refusal(lay) is None]
    valid = [lay for lay in cands if parity.refusal(lay) is None]
    step = max(len(valid) // blocks, size)
    return [lay for b in range(blocks) for lay in valid[offset + b * step: offset + b * step + size]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="gpt2")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--names", default="cp", help="comma-separated name parts ('' for all)")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=0, help="runs of consecutive valid layouts instead of --every")
    ap.add_argument("--block-size", type=int, default=12)
    ap.add_argument("--profile", default=None, help="folder for per-rank cProfile dumps")
    ap.add_argument("--per-layout", action="store_true", help="report each layout's training CPU seconds")
    ap.add_argument("--json", default=None, help="append the result as one JSON line to this file")
    a = ap.parse_args(argv)

    import torch

    from zerotron import parity
    from zerotron.data import prepare_data
    from zerotron.distributed.mesh import init_distributed
    from zerotron.testing import run_ranks, tiny_config

    init_distributed("gloo", timeout_s=120)
    tmp = tempfile.mkdtemp(prefix="matrix_cpu_")
    cache = os.path.join(tmp, "cache")
    d = tiny_config({"data.cache_dir": cache}).data
    prepare_data(d.corpus, None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir)
    extra = {"data.cache_dir": cache, **parity.MODELS[a.family]}
    names = [n for n in a.names.split(",") if n]
    lays = _slice(names, a.world, a.every, a.offset, a.blocks, a.block_size)
    c0 = time.process_time()
    ref = parity.reference(os.path.join(tmp, "ref"), extra)
    ref_cpu = time.process_time() - c0
    ref_path = os.path.join(tmp, "ref.pt")
    torch.save(ref, ref_path)
    keys = (set(ref["params"]), set(ref["optim"]))
    warm = [parity.Layout("ddp", a.world, 1, False, 1, None, 1).as_dict()]  # pays each rank's imports
    run_ranks(_rank_body, a.world, [(warm, ref_path, os.path.join(tmp, "warm"), extra)], None, timeout_s=120)
    load0 = os.getloadavg()[0]
    w0 = time.time()
    prof = a.profile and os.path.abspath(a.profile)
    if prof:
        os.makedirs(prof, exist_ok=True)
    per_rank = run_ranks(_rank_body, a.world, [([l.as_dict() for l in lays], ref_path, os.path.join(tmp, "m"), extra)],
                         prof, timeout_s=120, join_timeout_s=60 * len(lays) + 300)
    wall = time.time() - w0
    worst = 0.0
    for i, lay in enumerate(lays):
        s = parity.check(lay.name, [per_rank[r][0][0][i] for r in range(a.world)], keys, parity.FP64_RTOL)
        worst = max(worst, *(s[k] for k in parity.ERRORS))
    cpu = [per_rank[r][1] for r in range(a.world)]
    res = {"tree": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(parity.__file__)))), "family": a.family,
           "world": a.world, "names": names, "every": a.every, "offset": a.offset, "blocks": a.blocks, "block_size": a.block_size, "layouts": len(lays),
           "cpu_per_layout_per_rank": round(sum(cpu) / len(cpu) / len(lays), 4),
           "cpu_per_rank": [round(c, 2) for c in cpu],
           "main_thread_cpu_per_rank": [round(per_rank[r][3], 2) for r in range(a.world)],
           "threads_rank0": per_rank[0][4], "wall_s": round(wall, 1),
           "wall_per_layout": round(wall / len(lays), 3), "reference_cpu_s": round(ref_cpu, 2),
           "worst_rel_err": worst, "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2),
           "profiled": bool(prof)}
    res["phase_cpu_per_layout_per_rank"] = {
        k: round(sum(per_rank[r][6].get(k, 0.0) for r in range(a.world)) / a.world / len(lays), 4)
        for k in per_rank[0][6]}
    if a.per_layout:
        res["per_layout_cpu_mean_over_ranks"] = {
            n: round(sum(per_rank[r][5][n] for r in range(a.world)) / a.world, 3) for n in per_rank[0][5]}
    print(json.dumps(res))
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
