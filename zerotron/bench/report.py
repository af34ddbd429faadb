"""Reporting for ``zerotron bench train``: per-layout summaries over rounds, paired ratios, the
markdown table, the bar-chart PNG (tokens/s and time per epoch); the percentile every bench
reports (:func:`percentile`)."""
from __future__ import annotations

import re
import statistics

from zerotron.out_files import out_path

BASELINES = ("dp-torch", "single")  # ratio columns: tokens/s relative to these layouts
# "vs flat" column: each hierarchical layout (HSDP) against its flat counterpart of the same run
FLAT_OF = {"hsdp-zero2": "zero2", "hsdp-zero3": "zero3", "fsdp2-hsdp": "fsdp2-zero3", "dp-hier": "dp"}
# "vs no offload" column: each offload layout against the same ZeRO stage without offload
OFFLOAD_OF = {f"zero{s}-{kind}": f"zero{s}" for s in (1, 2, 3) for kind in ("offload", "offdisk")}
OFFLOAD_KEYS = ("offload_copy_s_per_step", "offload_wait_s_per_step", "offload_hidden", "offload_io_s_per_step",
                "offload_io_wait_s_per_step", "offload_io_hidden")


def percentile(xs: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of ``xs``: the sorted value at index
    round(q x (n - 1)); None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def paired_ratio(num: list[float], den: list[float]) -> float | None:
    """Median over rounds of ``num[r] / den[r]``; None unless both have the same length >= 1 and no zero."""
    if not num or len(num) != len(den) or not all(num) or not all(den):
        return None
    return statistics.median(a / b for a, b in zip(num, den))


def summarize(records: list[dict]) -> list[dict]:
    """Per-(round, layout) records -> one row per layout: medians over rounds, ``ratio_vs_<base>``."""
    rows = []
    for name in dict.fromkeys(r["layout"] for r in records):
        rs = [r for r in records if r["layout"] == name]
        if any(r["skipped"] for r in rs):
            rows.append({k: v for k, v in next(r for r in rs if r["skipped"]).items() if k != "round"})
            continue
        row = {k: v for k, v in rs[0].items() if k not in ("round", "step_times_s")}
        row.update(tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs),
                   tokens_per_s_rounds=[r["tokens_per_s"] for r in rs],
                   step_time_s=statistics.median(r["step_time_s"] for r in rs),
                   **({"mfu": statistics.median(r["mfu"] for r in rs)} if all("mfu" in r for r in rs) else {}),
                   cpu_s_per_step=statistics.median(r["cpu_s_per_step"] for r in rs),
                   step_time_s_rounds=[r["step_time_s"] for r in rs],
                   step_times_s_rounds=[r["step_times_s"] for r in rs],
                   comm_bytes_per_step=max(r["comm_bytes_per_step"] for r in rs),
                   peak_mem_bytes=max(r["peak_mem_bytes"] for r in rs), rounds=len(rs))
        if all("peak_above_floor_bytes" in r for r in rs):
            row["peak_above_floor_bytes"] = max(r["peak_above_floor_bytes"] for r in rs)
        row.pop("bubble_measured_steps", None)
        row.pop("bubble_simulated_steps", None)
        row.pop("idle_split_steps", None)
        row.pop("bubble_replayed_steps", None)
        if all("bubble_replayed_steps" in r for r in rs):
            meas = [b for r in rs for b in r["bubble_measured_steps"]]
            rep = [b for r in rs for b in r["bubble_replayed_steps"]]
            row.update(bubble_replayed=statistics.median(rep), bubble_replay_ratio=paired_ratio(meas, rep))
        if all("idle_split_steps" in r for r in rs):  # medians over every timed step of every round
            for k in rs[0]["idle_split_steps"][0]:
                vals = [x[k] for r in rs for x in r["idle_split_steps"] if x.get(k) == x.get(k)]  # NaN: none measured
                row[k] = statistics.median(vals) if vals else float("nan")
        if all("link_tx_bytes_per_step" in r for r in rs):
            row["link_tx_bytes_per_step"] = statistics.median(r["link_tx_bytes_per_step"] for r in rs)
        if "compile_time_s" in rs[0]:  # -compile layouts: the first round compiles, the later ones reuse
            row.update(compile_time_s=max(r["compile_time_s"] for r in rs), recompiles=sum(r["recompiles"] for r in rs),
                       warmup_s=max(r["warmup_s"] for r in rs))
        for k in OFFLOAD_KEYS:  # host copies / disk I/O hidden behind compute: medians over rounds
            row.pop(k, None)
            if all(r.get(k) is not None for r in rs):
                row[k] = statistics.median(r[k] for r in rs)
        if "epoch_tokens" in rs[0]:
            row["epoch_time_s"] = rs[0]["epoch_tokens"] / row["tokens_per_s"]
        if "bubble_measured" in rs[0]:
            row.update(bubble_measured=statistics.median(b for r in rs for b in r["bubble_measured_steps"]),
                       bubble_theory=rs[0]["bubble_theory"])
        if "bubble_simulated" in rs[0]:  # measured / simulated: median of the paired per-step ratios
            meas = [b for r in rs for b in r["bubble_measured_steps"]]
            sim = [b for r in rs for b in r["bubble_simulated_steps"]]
            st = rs[0]["stage_compute_s"]
            row.update(bubble_simulated=statistics.median(sim), bubble_overhead_ratio=paired_ratio(meas, sim),
                       stage_compute_s={k: {s: statistics.median(r["stage_compute_s"][k][s] for r in rs) for s in v}
                                        for k, v in st.items()})
        rows.append(row)
    by_name = {r["layout"]: r for r in rows}
    for row in rows:
        for b in BASELINES:
            if b in by_name and not row["skipped"]:
                row[f"ratio_vs_{b}"] = paired_ratio(row["tokens_per_s_rounds"], by_name[b].get("tokens_per_s_rounds"))
        flat = by_name.get(FLAT_OF.get(_base(row["layout"]), ""))
        if flat is not None and not row["skipped"] and not flat["skipped"]:
            row["ratio_vs_flat"] = paired_ratio(row["tokens_per_s_rounds"], flat.get("tokens_per_s_rounds"))
            if "link_tx_bytes_per_step" in row and flat.get("link_tx_bytes_per_step"):
                row["link_bytes_vs_flat"] = row["link_tx_bytes_per_step"] / flat["link_tx_bytes_per_step"]
        plain = by_name.get(OFFLOAD_OF.get(_base(row["layout"]), ""))
        if plain is not None and not row["skipped"] and not plain["skipped"]:
            row["ratio_vs_no_offload"] = paired_ratio(row["tokens_per_s_rounds"], plain.get("tokens_per_s_rounds"))
        eager = by_name.get(row["layout"].removesuffix("-compile")) if row["layout"].endswith("-compile") else None
        if eager is not None and not row["skipped"] and not eager["skipped"]:  # paired per round
            row["ratio_vs_eager"] = paired_ratio(row["tokens_per_s_rounds"], eager.get("tokens_per_s_rounds"))
    return rows


def _base(name: str) -> str:
    """Layout name without its -mbN / -acX suffixes (``layouts.get_layout``)."""

    while (m := re.search(r"-(mb[1-9][0-9]*|acselective|acfull)$", name)) and name[:m.start()]:
        name = name[:m.start()]
    return name


def impl_name(strategy, dp: int, sequence_parallel: bool = False, cp: int = 1, cp_impl: str = "ring") -> str:
    """What a layout runs, for the table's impl column: the strategy class, prefixed by
    "TensorParallel" (``+SP``) when the model is tensor-parallel (``strategy.tp_group`` set); a
    data-parallel wrapper over a single dp rank (the ``tp`` layouts) is not named: it does nothing.
    Context parallelism (``cp > 1``) adds `` x CP2 (ring)`` (degree and ``parallel.cp_impl``)."""
    name = type(strategy).__name__
    ctx = f" x CP{cp} ({cp_impl})" if cp > 1 else ""
    if getattr(strategy, "tp_group", None) is None:
        return name + ctx
    tp = "TensorParallel+SP" if sequence_parallel else "TensorParallel"
    return (tp if dp == 1 and name in ("DataParallel", "TorchDDP") else f"{tp} x {name}") + ctx


def _f(v, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: list[dict]) -> str:
    """Markdown table, one line per layout; skipped layouts show their error. The epoch, split and
    bubble columns appear only when some row has the field (pipeline layouts: ``pp_split``,
    ``bubble_measured``, the idle split ``idle_dependency``/``idle_transfer``/``idle_post`` and
    ``start_skew_ms`` (native executor), ``bubble_simulated``, ``bubble_overhead_ratio``,
    ``bubble_replayed``, ``bubble_replay_ratio``, ``bubble_sim_latency``, ``latency_ratio``,
    ``bubble_theory``)."""
    bases = [b for b in BASELINES if any(r["layout"] == b and not r["skipped"] for r in rows)]
    extra = [k for k in ("mfu", "epoch_time_s", "pp_split", "bubble_measured", "idle_dependency", "idle_transfer",
                         "idle_post", "start_skew_ms", "p2p_latency_ms", "bubble_simulated", "bubble_overhead_ratio", "bubble_replayed",
                         "bubble_replay_ratio", "bubble_sim_latency", "latency_ratio", "bubble_theory", "ratio_vs_flat", "link_tx_bytes_per_step", "link_bytes_vs_flat",
                         "compile_time_s", "recompiles", "ratio_vs_eager", "ratio_vs_no_offload", "offload_hidden",
                         "offload_io_hidden")
             if any(k in r for r in rows)]
    names = {"mfu": ("MFU (measured matmul peak)", ".3f"), "epoch_time_s": ("epoch s", ",.1f"), "bubble_measured": ("bubble measured", ".3f"),
             "bubble_simulated": ("bubble sim (measured F/B)", ".3f"), "bubble_overhead_ratio": ("measured / sim", ".2f"),
             "bubble_replayed": ("bubble replay (per-action times)", ".3f"),
             "bubble_replay_ratio": ("measured / replay", ".2f"),
             "idle_dependency": ("idle: wait for sender", ".3f"), "idle_transfer": ("idle: p2p transfer", ".3f"),
             "idle_post": ("idle: post + send wait", ".3f"), "start_skew_ms": ("start skew ms", ".1f"),
             "p2p_latency_ms": ("p2p latency ms", ".2f"),
             "bubble_sim_latency": ("bubble sim + p2p latency", ".3f"),
             "latency_ratio": ("measured / (sim + latency)", ".2f"),
             "pp_split": ("split", "s"), "bubble_theory": ("bubble theory", ".3f"),
             "ratio_vs_flat": ("tokens/s vs flat", ".3f"),
             "link_tx_bytes_per_step": ("link bytes/step", ",.0f"), "link_bytes_vs_flat": ("link bytes vs flat", ".3f"),
             "compile_time_s": ("compile s (first round)", ".1f"), "recompiles": ("recompiles (timed)", "d"),
             "ratio_vs_eager": ("compiled / eager", ".3f"), "ratio_vs_no_offload": ("tokens/s vs no offload", ".3f"),
             "offload_hidden": ("host copies hidden", ".3f"), "offload_io_hidden": ("disk I/O hidden", ".3f")}
    head = ["layout", "impl", "world", "tokens/s median", "min-max", "step ms median", *[f"vs {b}" for b in bases],
            "CPU s/step", "comm bytes/step", "model-state bytes/rank", "peak mem MiB",
            *[names[k][0] for k in extra]]
    out = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for r in rows:
        if r["skipped"]:
            out.append(f"| {r['layout']} | skipped: {r['error'][:200].replace('|', '/')} |" + " |" * (len(head) - 2))
            continue
        tps = r["tokens_per_s_rounds"]
        out.append("| " + " | ".join([
            r["layout"], r["impl"], str(r["world_size"]), _f(r["tokens_per_s"]), f"{min(tps):,.0f}-{max(tps):,.0f}",
            _f(r["step_time_s"] * 1e3, ".1f"), *[_f(r.get(f"ratio_vs_{b}"), ".3f") for b in bases],
            _f(r["cpu_s_per_step"], ".3f"),
            "- (1 rank)" if r["world_size"] == 1 else _f(r["comm_bytes_per_step"], ",") + (
                " + torch's own (not counted)" if r["impl"] in ("FSDP2Strategy", "DTensorTPStrategy") else ""),
            _f(r["model_state_bytes"], ","),
            _f(r["peak_mem_bytes"] / 2**20), *[_f(r.get(k), names[k][1]) for k in extra]]) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """PNG with two panels (Agg, no pyplot): median tokens/s per layout (whiskers = min/max over
    rounds) and, when measured, the time per epoch of the train split in seconds (the seed
    article's "1 vs N processes" comparison)."""
    from matplotlib.figure import Figure

    rows = [r for r in rows if not r["skipped"]]
    med = [r["tokens_per_s"] for r in rows]
    err = [[m - min(r["tokens_per_s_rounds"]) for m, r in zip(med, rows)],
           [max(r["tokens_per_s_rounds"]) - m for m, r in zip(med, rows)]]
    epochs = all(r.get("epoch_time_s") for r in rows)
    fig = Figure(figsize=(1.5 * len(rows) + 2.5, 7.5 if epochs else 4))
    axes = fig.subplots(2, 1) if epochs else [fig.add_subplot()]
    labels = [f"{r['layout']}\n{r['world_size']} rank(s)" for r in rows]
    colors = [f"C{i % 10}" for i in range(len(rows))]
    axes[0].bar([f"{lab}\n{m:,.0f} tok/s" for lab, m in zip(labels, med)], med, yerr=err, capsize=4, color=colors)
    axes[0].set_ylabel("tokens/s (median over rounds; whiskers min-max)")
    axes[0].set_title(title, fontsize=8)
    if epochs:
        times = [r["epoch_time_s"] for r in rows]
        axes[1].bar([f"{lab}\n{t:,.0f} s" for lab, t in zip(labels, times)], times, color=colors)
        axes[1].set_ylabel("time per epoch (s) at the median tokens/s")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path(path), dpi=110, bbox_inches="tight")


def markdown_report(rows: list[dict], command: str, machine: str) -> str:
    """The ``--markdown`` file: command, machine, model, table, how to read it."""
    r0 = next((r for r in rows if not r["skipped"]), {})
    return "\n".join([
        f"# Training throughput: {', '.join(r['layout'] for r in rows)}", "", f"Command: `{command}`", "",
        f"Machine: {machine}", "", f"Model: {_f(r0.get('num_params'), ',')} parameters, "
        f"{_f(r0.get('tokens_per_step'), ',')} tokens per optimizer step; {r0.get('rounds', 0)} rounds of "
        f"{r0.get('warmup', 0)} untimed + {r0.get('steps', 0)} timed steps per layout, order rotated each round.", "",
        format_table(rows), "", "tokens/s: median over rounds (min-max over rounds beside it). `vs X`: median over "
        "rounds of the paired per-round ratio tokens/s(layout) / tokens/s(X). MFU: tokens/s x model training "
        "FLOPs per token (6N + 12LCS, recomputation not counted) / the sum over the layout's ranks of each rank's "
        "measured matmul peak (best of >= 8 fp32 1024^2 products, per process; median over rounds). CPU s/step: process CPU seconds per "
        "step summed over ranks (median over rounds). comm bytes/step: counted by "
        "zerotron.distributed.comm (nccl-tests size; not shown for 1 rank, where the all-reduces move nothing; FSDP2's and "
        "DTensor TP's own collectives bypass it and are not counted). peak mem: "
        f"{r0.get('peak_mem_kind', '-')} per rank, max over ranks. epoch s: one epoch of the train split "
        "(num_windows x seq_len tokens) / tokens/s. bubble measured (pipeline layouts): median over timed steps "
        "of the max over pp ranks of idle/(busy+idle) (bubble plus p2p transfer); idle: wait for sender / p2p "
        "transfer / post + send wait (native executor, ranks on one host): that rank's idle split into receive "
        "waits before the matching send was posted, receive waits after it (p2p latency and wake-ups: executor "
        "overhead), and time posting ops or waiting for sends, as fractions of its walk (they add up to bubble "
        "measured; medians per column, so the sum of the medians may differ slightly); start skew: how much "
        "later the last pp rank began the step's pipeline walk than the first; p2p latency: median one-way "
        "latency (send posted to receive complete) of the receives already waiting when their send was posted, "
        "what each message on the critical path costs; bubble sim (measured F/B): "
        "the same statistic predicted by the schedule simulator fed with each stage's measured mean F and B "
        "times (communication free, sends completing in the background), so measured / sim (median of per-step "
        "ratios) is executor overhead plus the extra waits compute-time jitter causes, and sim vs theory is stage "
        "imbalance; bubble replay (per-action times): the simulator fed with every action's own measured duration "
        "of the step (jitter kept, communication free), so measured / replay is executor overhead alone; bubble sim + p2p latency: the simulation from the "
        "means again with every cross-rank message taking the step's measured p2p latency, so measured / (sim + "
        "latency) (median of per-step ratios) is what is left once the latency on the critical path is priced "
        "in (jitter, posting, skew); split: layers per model stage; bubble theory: "
        "(p-1)/(v*m+p-1) ((p-1)/(3m+p-1) for zb-h1). tokens/s vs flat (HSDP layouts): paired ratio against "
        "the flat layout (hsdp-zeroS vs zeroS, fsdp2-hsdp vs fsdp2-zero3, dp-hier vs dp). link bytes/step "
        "(multi-node): the inter-node interface's tx_bytes counters summed over the nodes per timed step "
        "(median over rounds), link bytes vs flat the same ratio. Method: zerotron/bench/train.py.", ""])
