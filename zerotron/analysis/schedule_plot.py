"""Pictures and the ``zerotron schedule`` command for pipeline schedules.

Draws a :class:`zerotron.parallel.pipeline.simulation.SimResult` as a timeline (one row per pipeline rank,
the usual figure of GPipe, Huang et al. 2019, and Megatron-LM, Narayanan et al. 2021) and prints the
simulated vs theoretical bubble (formulas documented in ``zerotron.parallel.pipeline.simulation``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict

from zerotron.out_files import out_file_refusal, out_path
from zerotron.parallel.pipeline.schedules import KINDS, build_schedule, check_schedule
from zerotron.parallel.pipeline.simulation import SimResult, bubble_theory, bubble_time_theory, simulate
from zerotron.plan import CHUNKED_SCHEDULES


def _label(action) -> str:
    return str(action.microbatch) if action.chunk == 0 else f"{action.microbatch}.{action.chunk}"


def draw_schedule(sim: SimResult, pp: int, out_png: str, title: str) -> str:
    """Write a PNG timeline of ``sim`` to ``out_png`` and return the path.

    One row per rank (rank 0 on top), x = simulated time (units of the costs). F blocks are
    coloured by micro-batch; B blocks use a darker shade of the same colour with hatching; W blocks
    (weight gradients of a split backward, zb-h1) a lighter shade with dots; idle time is left blank. Blocks carry the micro-batch number ("mb.chunk" for chunks > 0 when interleaved).
    Uses matplotlib's Agg canvas directly, so no global backend is changed. Raises ValueError if
    ``sim`` does not have ``pp`` rank rows; OSError if the file cannot be written.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if len(sim.intervals) != pp:
        raise ValueError(f"sim has {len(sim.intervals)} rank rows, expected pp={pp}")
    fig = Figure(figsize=(max(6.0, min(24.0, 0.35 * sim.makespan + 2)), 0.6 * pp + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["tab20"]
    for rank, rows in enumerate(sim.intervals):
        for start, end, action in rows:
            rgb = cmap((action.microbatch % 10) * 2 / 20)[:3]  # tab20: even indices = strong hues
            backward = action.kind == "B"
            if action.kind == "W":
                color = tuple(0.55 + 0.45 * c for c in rgb)
            else:
                color = tuple(0.6 * c for c in rgb) if backward else rgb
            ax.barh(rank, end - start, left=start, height=0.8, color=color, edgecolor="black",
                    linewidth=0.5, hatch={"B": "//", "W": ".."}.get(action.kind))
            ax.text((start + end) / 2, rank, _label(action), ha="center", va="center",
                    fontsize=7, color="white" if backward else "black")
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, max(sim.makespan, 1e-9))
    ax.set_xlabel("time (units of the costs; F = one forward of a micro-batch)")
    ax.set_ylabel("pipeline rank")
    ax.set_title(f"{title}  (bubble {sim.bubble_fraction:.3f})")
    split = any(a.kind == "W" for rows in sim.intervals for _, _, a in rows)
    handles = [Patch(facecolor="lightgray", edgecolor="black", label="forward F"),
               Patch(facecolor="dimgray", edgecolor="black", hatch="//",
                     label="input-gradient backward B" if split else "backward B")]
    if split:
        handles.append(Patch(facecolor="gainsboro", edgecolor="black", hatch="..", label="weight gradients W"))
    handles.append(Patch(facecolor="white", edgecolor="black", label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(handles), fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path(out_png), dpi=120, bbox_inches="tight")
    return out_png


def ascii_timeline(sim: SimResult, max_width: int = 160) -> str:
    """A text timeline: one line per rank; F cells are lower-case letters, B cells upper-case
    (a/A = micro-batch 0, wrapping after 26), W cells (split backward) digits (micro-batch mod 10),
    '.' is idle. One cell is the shortest compute, widened
    so the line fits ``max_width`` characters (then short blocks may round away)."""
    durations = [e - s for rows in sim.intervals for s, e, _ in rows if e > s]
    if not durations:
        return "\n".join(f"rank {r} |" for r in range(len(sim.intervals)))
    cell = max(min(durations), sim.makespan / max_width)
    width = round(sim.makespan / cell)
    lines = []
    for rank, rows in enumerate(sim.intervals):
        line = ["."] * width
        for start, end, action in rows:
            if action.kind == "W":
                ch = str(action.microbatch % 10)
            else:
                ch = chr((ord("a") if action.kind == "F" else ord("A")) + action.microbatch % 26)
            for x in range(round(start / cell), min(width, round(end / cell))):
                line[x] = ch
        lines.append(f"rank {rank} |{''.join(line)}|")
    return "\n".join(lines)


def schedule_main(argv: list) -> int:
    """``zerotron schedule --pp P --microbatches M --kind K [--virtual V] [--f-cost F] [--b-cost B]
    [--w-cost W] [--latency L] [--out F.png] [--json]``: build, check (deadlock-free with waited sends too) and
    simulate a pipeline schedule with the executor's timing (``simulate(..., eager_sends=True)``)
    and report it (simulated vs theory bubble, peak in-flight micro-batches per rank, ASCII
    timeline; ``--out`` writes a PNG). A kind that does not split the backward runs B + W as one
    B; ``--latency`` prices every cross-rank message (``simulate(..., latency=L)``, e.g. the
    ``p2p latency ms`` that ``zerotron bench train`` measures, in the units of the costs; the
    theory column stays latency-free). Theory: ``bubble_theory`` (uniform stages), for zb-h1 idle / (idle + m(F+B+W)) with idle =
    ``bubble_time_theory`` (m >= pp; null below); for zb-v the synchronous-step bound
    (p-1) F / 2 the same way (its order is checked with background sends only). With ``--json`` prints an object with
    ``bubble_simulated``, ``bubble_theory``, ``idle_per_rank``, ``makespan``, ``peak_in_flight``,
    ``actions`` (per rank) and ``intervals``. Returns 0, or 2 on a usage/value
    error (message on stderr)."""
    parser = schedule_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 0 if exc.code in (0, None) else 2
    return _schedule_run(args)


def schedule_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zerotron schedule``."""
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    parser = OneLineErrorParser(prog="zerotron schedule", formatter_class=HelpFormatter,
                                     description="Simulate and draw a pipeline schedule.")
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per flush")
    parser.add_argument("--kind", required=True, choices=KINDS, help="schedule")
    parser.add_argument("--virtual", type=int, default=None,
                        help="chunks per rank (interleaved only; default 2 there, else 1)")
    parser.add_argument("--f-cost", type=float, default=1.0, help="forward time per micro-batch")
    parser.add_argument("--b-cost", type=float, default=1.0,
                        help="input-gradient backward (B) time per micro-batch")
    parser.add_argument("--w-cost", type=float, default=1.0,
                        help="weight-gradient backward (W) time per micro-batch (B + W fused unless the kind splits them)")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="time of each cross-rank message, send posted to delivered (default 0)")
    parser.add_argument("--out", help="write a PNG timeline here")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser


MAX_ACTIONS = 4096  # pp x microbatches x virtual stages that `zerotron schedule` simulates and draws


def _schedule_run(args) -> int:
    v = args.virtual if args.virtual is not None else (2 if args.kind in CHUNKED_SCHEDULES else 1)
    try:

        for name, c, lo in (("--f-cost", args.f_cost, 0.0), ("--b-cost", args.b_cost, 0.0), ("--w-cost", args.w_cost, None)):
            if not math.isfinite(c) or c > 1e6 or (c <= 0 if lo is not None else c < 0):
                raise ValueError(f"{name} must be a finite number {'> 0' if lo is not None else '>= 0'} and "
                                 f"<= 1e6, got {c}")
        if not math.isfinite(args.latency) or not 0 <= args.latency <= 1e6:
            raise ValueError(f"--latency must be a finite number >= 0 and <= 1e6, got {args.latency}")
        if args.pp * args.microbatches * v > MAX_ACTIONS:
            raise ValueError(f"--pp x --microbatches x virtual stages = {args.pp * args.microbatches * v} is more than "
                             f"this tool draws ({MAX_ACTIONS}); use fewer micro-batches or stages")
        if args.out and not args.out.lower().endswith(".png"):
            raise ValueError(f"--out must name a .png file, got {args.out!r}")
        refusal = out_file_refusal(args.out, "--out", "schedule.png")  # before drawing: one line, not an OSError
        if refusal:
            raise ValueError(refusal)
        schedule = build_schedule(args.pp, args.microbatches, args.kind, v)
        check_schedule(schedule, args.pp, args.microbatches, v)
        costs = (args.f_cost, args.b_cost, args.w_cost)
        v_shaped = schedule.placement.shape == "v"
        if not v_shaped:  # zb-v's order needs background sends (the executor's gloo path; the plan refuses NCCL)
            simulate(schedule, args.pp, v, *costs)  # raises on deadlock even if sends were waited for
        sim = simulate(schedule, args.pp, v, *costs, eager_sends=True, latency=args.latency)
        split_bw = args.kind in ("zb-h1", "zb-v")
        theory = bubble_theory(args.pp, args.microbatches, v, args.kind)
        if args.kind == "zb-h1":
            idle = bubble_time_theory(args.pp, "zb-h1", *costs)
            theory = idle / (idle + args.microbatches * sum(costs)) if args.microbatches >= args.pp else None
        if v_shaped:  # the synchronous-step bound (p-1) T_F / 2 (schedules module docstring)
            idle = (args.pp - 1) * args.f_cost / 2
            theory = idle / (idle + args.microbatches * sum(costs)) if args.microbatches >= args.pp else None
        title = f"{args.kind} pp={args.pp} m={args.microbatches}" + (f" v={v}" if v > 1 else "")
        if args.out:
            draw_schedule(sim, args.pp, args.out, title)
    except (ValueError, OSError) as exc:
        print(f"zerotron schedule: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "kind": args.kind, "pp": args.pp, "microbatches": args.microbatches,
            "virtual_stages": v, "f_cost": args.f_cost, "b_cost": args.b_cost, "w_cost": args.w_cost,
            "latency": args.latency,
            "bubble_simulated": sim.bubble_fraction, "bubble_theory": theory, "idle_per_rank": sim.idle,
            "makespan": sim.makespan, "peak_in_flight": sim.peak_in_flight, "png": args.out,
            "actions": [[asdict(a) for a in rank] for rank in schedule],
            "intervals": [[[s, e, a.kind, a.microbatch, a.chunk] for s, e, a in rank]
                          for rank in sim.intervals],
        }))
        return 0
    print(f"{title}  (F={args.f_cost:g}, B={args.b_cost:g}, W={args.w_cost:g} per micro-batch"
          + (f", {args.latency:g} per message" if args.latency else "")
          + (")" if split_bw else "; backward B+W fused)"))
    shown = f"{theory:.4f}" if theory is not None else "n/a (m < pp)"
    print(f"bubble simulated {sim.bubble_fraction:.4f}   theory {shown}   "
          f"makespan {sim.makespan:g}   idle per rank {max(sim.idle):g}")
    unit = "(micro-batch, chunk) units" if v > 1 else "micro-batches"  # a chunk holds 1/v of a rank's layers
    print(f"peak in-flight {unit} per rank: {sim.peak_in_flight}")
    print(ascii_timeline(sim))
    print("(lower case = forward, upper case = backward"
          + (" B, digit = weight gradients W" if split_bw else "") + ", a = micro-batch 0, '.' = idle)")
    if args.out:
        print(f"wrote {args.out}")
    return 0
