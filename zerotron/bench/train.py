"""``zerotron bench train``: training throughput of parallel layouts, alternated in one run.

Usage: ``zerotron bench train [--nproc N] [--config F] [--layouts dp,dp-torch,single] [--steps K]
[--warmup W] [--rounds R] [--json F] [--plot F.png] [--markdown F.md] [--section.field V ...]``
(or ``python -m zerotron.bench.train``). With ``--nproc > 1`` outside a worker it re-runs itself in
N local workers. A *layout* (:data:`LAYOUTS`) is a name plus config overrides applied on top of the
file and the CLI overrides (suffixes ``-mbN``, ``-acselective|-acfull`` and ``-even|-auto`` set the
micro-batch, activation checkpointing and pipeline split of any layout: :func:`get_layout`); it runs on all N ranks or, with ``world=w``, on ranks 0..w-1 while the
others wait at a barrier. A layout whose config is refused or whose strategy cannot be built is
reported as skipped with the error (the run goes on).

Method. Each round runs every layout (order rotated by one per round), built from scratch (same seed
and initial weights; data from the token cache): ``warmup`` untimed then ``steps`` timed
``train_step`` calls on the real global batches of steps 0, 1, ...; a barrier over all ranks starts
the clock. As in the trainer, a layout's mesh is its plan's dims (``plan.build_plan``, cp included):
each rank trains its dp rank's share of the global batch, cut to its cp rank's zigzag chunks
(``parallel.context.split``), and target tokens are counted over the batch group (dp x cp). Per round: tokens/s = steps x global_batch x seq_len / (max over ranks of the elapsed
seconds); step time (s) = median over steps of the max over ranks. Reported: medians over rounds;
ratios ``vs X`` = median over rounds of the paired ratio tokens/s(layout) / tokens/s(X) of the same
round. CPU s/step: process CPU seconds (all threads) of the timed steps / steps, summed over ranks
(robust to other jobs taking the cores). comm bytes/step: ``comm.STATS`` bytes (nccl-tests size) of
the timed steps / steps, max over ranks. link bytes/step (multi-node runs with ``GLOO_SOCKET_IFNAME``,
e.g. ``zerotron.testing_netns``): the inter-node interface's tx_bytes counter over the timed steps,
summed over the nodes (local rank 0 of each reads its node's) / steps -- every byte that crossed
the node boundary, both directions, TCP/IP headers included. model-state bytes: ``Strategy.model_state_bytes`` total,
max over ranks. Peak memory (bytes): CPU, peak RSS (VmHWM) of the layout after a reset through
/proc/self/clear_refs (else the process-lifetime peak); CUDA, ``max_memory_allocated``.
epoch_time_s: seconds for one epoch of the train split (``num_windows x seq_len`` tokens, what the
global-batch sampler visits once) at the measured tokens/s. Pipeline layouts: ``bubble_measured`` =
median over timed steps of the max over pp ranks of ``PipelineStrategy.last_step_timing()
["bubble_fraction"]`` (idle / (busy + idle): bubble plus p2p transfer time); ``bubble_theory`` =
``simulation.bubble_theory(pp, m, v, kind)``, m = micro-batches per flush (1 for "naive");
``bubble_simulated`` = median over timed steps of what ``simulation.simulate`` predicts for the same
statistic when each model stage's F and B cost the step's measured mean times
(``pipeline.accounting.predicted_bubble``, communication free): measured / simulated is executor
overhead, simulated / theory the stage imbalance. ``stage_compute_s``: those per-stage times
(median over steps); ``pp_split``: the layers per model stage the layout ran. Native executor
(ranks on one host): ``idle_dependency`` / ``idle_transfer`` / ``idle_post`` (+ ``idle_post_cpu``,
``other_fraction``, ``start_skew_ms``) split the idlest rank's idle into waiting for the sender,
p2p transfer and posting (:func:`bubble.idle_split`), and ``bubble_replayed`` simulates each step with every
action's own measured duration (``pipeline.accounting.replayed_bubble``), so measured / replayed is
executor overhead without the compute jitter that measured / simulated also contains;
``bubble_sim_latency`` is the simulation from the means with every message taking the step's
measured ``p2p_latency_ms`` and ``latency_ratio`` measured / that (paired per step). A layout
suffix ``-p2pbatched`` / ``-p2peager`` runs the executor's other p2p posting modes
(:attr:`layouts.Layout.p2p`). Offload layouts (``zeroS-offload``, ``zeroS-offdisk``):
``offload_hidden`` = 1 - (seconds the ranks waited for their host copies) / (seconds the copy
threads ran), both summed over ranks and timed steps (``ZeroSync.offload_timing``), with the per-step
means per rank ``offload_copy_s_per_step`` / ``offload_wait_s_per_step``; ``offload_io_hidden`` the
same for the disk tier's I/O threads; ``ratio_vs_no_offload`` (report) the paired tokens/s ratio
against ``zeroS`` of the same run.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import platform
import re
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zerotron.config import load_config
from zerotron.data import GlobalBatchSampler, batch_from_indices, num_windows
from zerotron.dims import AXES
from zerotron.distributed import comm
from zerotron.distributed.mesh import Mesh
from zerotron.launch import strip_nproc
from zerotron.models.lora import apply_lora, lora_kwargs
from zerotron.models.moe import set_step_rows
from zerotron.models.registry import arch_of, build_model
from zerotron.out_files import check_out_files, write_out_file
from zerotron.parallel import DataParallel, TorchDDP, parallelize
from zerotron.parallel.compile import compile_stats
from zerotron.parallel.context.split import split_sequence
from zerotron.parallel.pipeline.simulation import bubble_theory
from zerotron.plan import build_plan
from zerotron.train.metrics import TRAIN_DTYPES, mfu, peak_flops
from zerotron.train.optim import build_scheduler
from zerotron.train.setup import gpt_config
from zerotron.train.step import train_step

from .bubble import P2P_KEYS, idle_split, simulated
from .entry import prologue, run_body
from .layouts import DEFAULT_LAYOUTS, LAYOUTS, Layout, get_layout, parse_layouts  # noqa: F401 (API)
from .report import BASELINES, format_table, impl_name, markdown_report, paired_ratio, plot, summarize  # noqa: F401 (API)

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.toml"


def _link_tx_bytes() -> int | None:
    """This node's bytes sent on its inter-node interface so far (``/sys/class/net/<if>/statistics/
    tx_bytes`` of ``GLOO_SOCKET_IFNAME``), read on local rank 0 only (one counter per node); None
    elsewhere, without the variable, on loopback or where the counter cannot be read."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if os.environ.get("LOCAL_RANK", "0") != "0" or not ifname or ifname == "lo" or "," in ifname:
        return None
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


def _peak_mem(dev, reset: bool = False) -> int:
    """Peak memory (bytes) since the last ``reset=True`` call: CUDA ``max_memory_allocated``; CPU the
    peak RSS (VmHWM; reset through /proc/self/clear_refs, Linux >= 4.0, after returning freed heap)."""
    if dev.type == "cuda":
        return torch.cuda.reset_peak_memory_stats(dev) if reset else int(torch.cuda.max_memory_allocated(dev))
    if reset:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):  # else VmHWM stays the lifetime peak
            ctypes.CDLL(None).malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")
        return 0
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def exact_cpu_memory(threshold: int = 128 * 1024) -> bool:
    """Make this process's resident set follow its live tensor bytes: glibc's ``mallopt``
    ``M_MMAP_THRESHOLD`` fixed at ``threshold`` bytes, so every block of that size or more is its own
    mapping, returned to the system when freed (glibc otherwise raises the threshold as large blocks
    are freed, up to 32 MiB, and keeps freed heap pages resident: a peak RSS then measures the heap's
    high-water mark, not the tensors alive at once). Costs a page fault per page of each new large
    block, so a run timed with it is not comparable to one without. Returns False where glibc's
    mallopt is not available (nothing changed)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(-3, int(threshold)))  # M_MMAP_THRESHOLD = -3
    except (OSError, AttributeError):
        return False


def _mem_now(dev) -> int:
    """Memory in use now (bytes): CUDA ``memory_allocated``; CPU the resident set (VmRSS). Taken right
    after the peak reset, it is the floor the layout's own tensors add to (interpreter, libraries,
    the loaded corpus, process-group buffers)."""
    if dev.type == "cuda":
        return int(torch.cuda.memory_allocated(dev))
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _mesh(cache: dict, dims, n: int, device):
    """Mesh of ``dims`` (cached; collective: built on ALL ranks); None on ranks outside a sub-world."""
    from torch.distributed.device_mesh import DeviceMesh

    key = tuple(dims.degrees.values())
    if key not in cache:
        if dims.world_size == n:
            cache[key] = Mesh(dims, device)
        else:  # the axes of ranks 0..w-1 (collective: all ranks build it and its groups)
            dm = DeviceMesh(device.type, torch.arange(dims.world_size).view(*key), mesh_dim_names=AXES)
            mesh = Mesh(dims, device, dm)
            cache[key] = mesh if mesh.member else None
    return cache[key]


def _build(cfg, plan, mesh, data, layout: Layout, steps: int):
    """``(strategy, optimizer, scheduler, micro-batches of steps 0..steps-1, n_params, seq_len,
    tokens in one epoch of the train split)``. Raises ValueError for a layout that splits the model
    over the ranks (``"{world}"`` degree) on one rank, NotImplementedError for a strategy
    ``parallelize`` does not provide."""
    split = [k for k, v in layout.overrides.items() if v == "{world}"]
    if split and mesh.dims.world_size == 1:
        raise ValueError(f"layout {layout.name} sets {', '.join(split)} = the world size: it needs 2 or more "
                         "ranks (--nproc 2); on 1 rank it would be the single-process layout")
    mcfg, t = gpt_config(cfg, data.vocab_size), cfg.train
    torch.manual_seed(t.seed)  # same initial weights on every rank and layout
    model = build_model(mcfg).to(mesh.device)
    if t.lora_rank:  # LoRA (the -lora layouts): base frozen, adapters trained, as the trainer does
        apply_lora(model, arch_of(model), **lora_kwargs(dataclasses.asdict(t)))
    set_step_rows(model, t.global_batch, t.micro_batch)  # MoE: the trainer's aux-loss weighting
    strategy = parallelize(model, plan, mesh)
    if layout.new_strategy and type(strategy) in (DataParallel, TorchDDP) and strategy.tp_group is None:
        raise NotImplementedError(f"parallelize() returned a plain {type(strategy).__name__} for "
                                  f"{layout.overrides}: this strategy is not implemented yet")
    if layout.p2p:  # executor p2p posting mode (bench knob, see Layout.p2p)
        q = strategy.executor.p2p
        q.batched, q.prefetch = layout.p2p == "batched", False
    opt = strategy.build_optimizer(t, strategy.decay_mask)
    sampler = GlobalBatchSampler(num_windows(len(data.train), mcfg.block_size), t.global_batch, t.seed)
    dpr, dp, mb, batches = mesh.local_rank("dp"), mesh.size("dp"), t.micro_batch, []
    cpr, cp = mesh.local_rank("cp"), mesh.size("cp")
    for s in range(steps):  # as the trainer: this dp rank's windows, this cp rank's zigzag chunks of each
        idx = sampler.local_indices(s, dpr, dp)
        mbs = (batch_from_indices(data.train, idx[i:i + mb], mcfg.block_size) for i in range(0, len(idx), mb))
        batches.append([(split_sequence(x, cp, cpr), split_sequence(y, cp, cpr)) for x, y in mbs])
    torch.manual_seed(t.seed + 1 + mesh.rank)
    epoch_tokens = num_windows(len(data.train), mcfg.block_size) * mcfg.block_size
    return strategy, opt, build_scheduler(opt, t), batches, model.num_params(), mcfg.block_size, epoch_tokens


def _flops_per_token(cfg, vocab_size: int, seq_len: int) -> int:
    """Model training FLOPs per token of ``cfg``'s model (6N + 12LCS, ``analysis.flops``; recomputation
    not counted): the numerator of the MFU column, as the trainer's metrics."""
    from zerotron.analysis.flops import shape_of, training_flops_per_token

    mcfg = gpt_config(cfg, vocab_size)
    return training_flops_per_token(shape_of(mcfg).flop_params(), mcfg.n_layer, mcfg.n_embd, seq_len)


def run_layout(layout: Layout, cfg, plan, mesh, data, steps: int, warmup: int, dev, threads: int, w: int) -> dict:
    """One round of one layout; collective over the world (ranks with ``mesh`` None just wait).
    Returns the same record on every rank (seconds, tokens/s, bytes) or a skipped record."""
    rec, err, built, local = {"layout": layout.name, "world_size": w}, None, None, None
    _peak_mem(dev, reset=True)
    floor = _mem_now(dev)
    compiled = cfg.train.compile
    cs0 = compile_stats() if compiled else None  # Dynamo's counters: process-wide, so deltas per round
    if mesh is not None:
        try:
            built = _build(cfg, plan, mesh, data, layout, warmup + steps)
        except Exception as e:  # noqa: BLE001 - a layout that cannot be built is reported, not fatal
            err = f"{type(e).__name__}: {e}"
    errs = [e for e in comm.all_gather_object(err) if e]
    if errs:
        return {**rec, "skipped": True, "error": errs[0]}
    if built:
        strat, opt, sched, batches, n_params, seq_len, epoch_tokens = built
        t, prev, times, bubbles, stage_times, pp_sched = cfg.train, torch.get_num_threads(), [], [], [], None
        p2p_steps = []
        timing = getattr(strat, "last_step_timing", None)
        offload_timing = getattr(strat, "offload_timing", lambda: {})
        torch.set_num_threads(threads)

        def step(s):
            train_step(strat, opt, sched, batches[s], mesh.group("batch"), t.grad_clip, t.dtype, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        t_warm = time.perf_counter()
        for s in range(warmup):
            step(s)
        t_warm = time.perf_counter() - t_warm
        cs1 = compile_stats() if compiled else None
    comm.barrier()  # the clock starts together on every rank
    if built:
        offload_timing()  # from here: the timed steps' host copies and disk I/O
        before, t0, c0 = dict(comm.STATS.bytes), time.perf_counter(), time.process_time()
        link0 = _link_tx_bytes()
        for s in range(warmup, warmup + steps):
            t1 = time.perf_counter()
            step(s)
            times.append(time.perf_counter() - t1)
            if timing is not None:
                tm = timing()
                bubbles.append(tm["bubble_fraction"])
                stage_times.append(tm["stage_compute_s"])
                pp_sched = tm["schedule"]
                if "p2p_events" in tm:  # the native executor: idle split, per-message timestamps
                    p2p_steps.append({k: tm[k] for k in P2P_KEYS})
        elapsed, cpu, by_tag = time.perf_counter() - t0, time.process_time() - c0, {}
        offload = offload_timing()
        link1 = _link_tx_bytes()  # before the all_gather_object below, which crosses the link too
        link = None if link0 is None or link1 is None else (link1 - link0) / steps
        for (op, g, tag), v in comm.STATS.bytes.items():
            by_tag[tag or "-"] = by_tag.get(tag or "-", 0) + v - before.get((op, g, tag), 0)
        local = {"elapsed": elapsed, "cpu": cpu, "times": times, "peak": _peak_mem(dev), "floor": floor, "link": link,
                 "degrees": mesh.dims.degrees,
                 "state": strat.model_state_bytes(opt),
                 "by_tag": {k: v // steps if v % steps == 0 else v / steps for k, v in by_tag.items() if v},
                 "impl": impl_name(strat, mesh.size("dp"), cfg.parallel.sequence_parallel, mesh.size("cp"),
                                   cfg.parallel.cp_impl), "params": n_params, "tokens": t.global_batch * seq_len,
                 "epoch_tokens": epoch_tokens, "bubbles": bubbles if timing is not None else None,
                 "stage_times": stage_times, "schedule": pp_sched, "offload": offload, "p2p": p2p_steps, "host": socket.gethostname(),
                 "peak_flops": peak_flops(dev, TRAIN_DTYPES[cfg.train.dtype])[0],  # measured once per process
                 "flops_per_token": _flops_per_token(cfg, data.vocab_size, seq_len),
                 "pipe": [mesh.coords["pp"], mesh.coords["dp"], mesh.coords["tp"]], "split": getattr(strat, "split", None),
                 "bubble_theory": bubble_theory(pp_sched[0], pp_sched[1], pp_sched[3], pp_sched[2]) if timing is not None else None}
        if compiled:  # compile time of this round's warm-up; recompiles/graph breaks in the timed steps (want 0)
            cs2 = compile_stats()
            local["compile"] = {"compile_time_s": cs1["compile_time_s"] - cs0["compile_time_s"], "warmup_s": t_warm,
                                "recompiles": cs2["recompiles"] - cs1["recompiles"],
                                "graph_breaks": cs1["graph_breaks"] - cs0["graph_breaks"],
                                "graphs": cs1["graphs"] - cs0["graphs"]}
        torch.set_num_threads(prev)
        del built, strat, opt, sched, batches, step
    got = [x for x in comm.all_gather_object(local) if x]
    times = [max(ts) for ts in zip(*(g["times"] for g in got))]
    state, g0 = max((g["state"] for g in got), key=lambda s: s["total_bytes"]), got[0]
    tps = g0["tokens"] * steps / max(g["elapsed"] for g in got)
    mfu_val = mfu(tps, g0["flops_per_token"], sum(g["peak_flops"] for g in got))  # over the layout's ranks
    pipe = {}
    if g0["bubbles"] is not None:  # max over (pp) ranks per step, median over steps
        pipe = {"bubble_measured": statistics.median(max(b) for b in zip(*(g["bubbles"] for g in got))),
                "bubble_measured_steps": [max(b) for b in zip(*(g["bubbles"] for g in got))],
                "bubble_theory": g0["bubble_theory"], **simulated(got, steps), **idle_split(got, steps)}
    if "compile" in g0:  # the slowest rank's compile, every rank's recompiles in the timed steps
        cs = [g["compile"] for g in got]
        pipe.update(compile_time_s=max(c["compile_time_s"] for c in cs), recompiles=sum(c["recompiles"] for c in cs),
                    graph_breaks=max(c["graph_breaks"] for c in cs), compiled_graphs=max(c["graphs"] for c in cs),
                    warmup_s=max(c["warmup_s"] for c in cs))
    if g0["offload"]:  # host copies (and disk I/O) of the timed steps, summed over ranks
        copy_s, wait_s = (sum(g["offload"]["offload_" + k] for g in got) for k in ("copy_s", "wait_s"))
        pipe.update(offload_copy_s_per_step=copy_s / steps / len(got), offload_wait_s_per_step=wait_s / steps / len(got),
                    offload_hidden=1 - wait_s / copy_s if copy_s > 0 else None)
        if "offload_io_s" in g0["offload"]:
            io_s, io_wait = (sum(g["offload"][k] for g in got) for k in ("offload_io_s", "offload_io_wait_s"))
            pipe.update(offload_io_s_per_step=io_s / steps / len(got), offload_io_wait_s_per_step=io_wait / steps / len(got),
                        offload_io_hidden=1 - io_wait / io_s if io_s > 0 else None)
    links = [g["link"] for g in got if g["link"] is not None]  # one per node
    link = {"link_tx_bytes_per_step": sum(links), "link_nodes": len(links)} if links else {}
    return {**rec, **link, "skipped": False, "impl": g0["impl"], "steps": steps, "warmup": warmup, "threads": threads,
            "num_params": g0["params"], "tokens_per_step": g0["tokens"],
            "tokens_per_s": tps, "mfu": mfu_val, "peak_flops_per_rank": statistics.mean(g["peak_flops"] for g in got),
            "epoch_tokens": g0["epoch_tokens"], "epoch_time_s": g0["epoch_tokens"] / tps, **pipe,
            "step_time_s": statistics.median(times), "step_times_s": times,
            "cpu_s_per_step": sum(g["cpu"] for g in got) / steps,
            "comm_bytes_per_step": max(sum(g["by_tag"].values()) for g in got), "comm_bytes_by_tag": g0["by_tag"],
            "model_state_bytes": state["total_bytes"], "model_state": state,
            "peak_mem_bytes": max(g["peak"] for g in got),
            "peak_above_floor_bytes": max(g["peak"] - g["floor"] for g in got), "degrees": g0["degrees"],
            "peak_mem_kind": "cuda max_memory_allocated" if dev.type == "cuda" else "peak RSS (VmHWM)"}


def run_benchmark(path, overrides, names: list[str], steps: int, warmup: int, rounds: int, dev, data) -> list[dict]:
    """Every round and layout (collective, on every rank); returns per-(round, layout) records."""
    n, threads, cache, skipped, records = dist.get_world_size(), torch.get_num_threads(), {}, {}, []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            layout = get_layout(name)
            w = layout.world or n
            if name not in skipped:
                try:  # deterministic, so every rank takes the same branch
                    if w > n:
                        raise ValueError(f"layout {name!r} needs {w} ranks, the run has {n}")
                    own = [(k, str(v).format(world=n)) for k, v in layout.overrides.items()]
                    cfg = load_config(path, [*overrides, *own])
                    plan = build_plan(cfg, w)  # the trainer's plan: its dims (dp, tp, pp, cp, HSDP) make the mesh
                    mesh = _mesh(cache, plan.dims, n, dev)
                except ValueError as e:  # ConfigError is a ValueError
                    skipped[name] = {"layout": name, "world_size": w, "skipped": True, "error": str(e)}
            rec = skipped.get(name) or run_layout(layout, cfg, plan, mesh, data, steps, warmup, dev,
                                                  threads * n // w if layout.all_threads else threads, w)
            skipped.update({name: rec} if rec["skipped"] else {})
            records.append({**rec, "round": r})
    return records


def _parser() -> argparse.ArgumentParser:
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    p = OneLineErrorParser(prog="zerotron bench train", allow_abbrev=False, formatter_class=HelpFormatter,
                                description="Training throughput of parallel layouts, alternated round by round; "
                                "--section.field VALUE overrides a config field for every layout (see 'zerotron "
                                "train --help' for the fields).")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                   help=f"comma list from: {', '.join(LAYOUTS)}; each optionally followed by -mbN (train.micro_batch "
                   "= N), -acselective | -acfull (train.activation_checkpointing), -even | -auto (parallel.pp_split) and, on "
                   "native pipeline layouts, -p2pbatched | -p2peager (the executor's p2p posting: one batch per comm run / "
                   "per op without early receives; default per op with the next run's receives posted early), "
                   "-compile (train.compile: rows add compile time and recompiles), -lora|-loraN (LoRA adapters of rank 8|N, "
                   "train.lora_rank), e.g. zero2-mb4-acfull, pp-1f1b-even-mb2, dp-compile, dp-lora")
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps per layout and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--rounds", type=int, default=8, help="rounds; the layout order rotates every round")
    for k in ("json", "plot", "markdown"):
        p.add_argument(f"--{k}", help=f"write the {k} output here (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench train``; returns an exit code (2 for bad arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def parse(argv):
        args, rest = _parser().parse_known_args(argv)
        check_out_files({"--json": args.json, "--plot": args.plot, "--markdown": args.markdown})
        args.names = parse_layouts(args.layouts)
        if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or args.nproc < 1:
            raise ValueError("--steps, --rounds and --nproc must be >= 1 and --warmup >= 0")
        return args, rest

    got = prologue("bench train", "zerotron.bench.train", argv, parse)
    if isinstance(got, int):
        return got
    args, overrides, cfg = got
    rank, n, dev, (records, backend) = run_body(cfg, lambda dev, data: (
        run_benchmark(args.config, overrides, args.names, args.steps, args.warmup, args.rounds, dev, data),
        dist.get_backend()))
    if rank != 0:
        return 0
    rows = summarize(records)
    machine = (f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, {backend}, {n} rank(s), "
               f"{dev.type}{f' ({torch.cuda.get_device_name(dev)})' if dev.type == 'cuda' else ''}, "
               f"{torch.get_num_threads()} intra-op thread(s) per rank")
    print(f"zerotron bench train: {machine}\n{format_table(rows)}")
    for r in rows:
        for b in BASELINES:
            if r["layout"] not in BASELINES and r.get(f"ratio_vs_{b}") is not None:
                print(f"{r['layout']} / {b} tokens/s: {r[f'ratio_vs_{b}']:.3f}")
    if args.json:
        write_out_file(args.json, json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot, f"zerotron bench train: {machine}")
    if args.markdown:
        command = " ".join(["zerotron bench train", *[f"--nproc {n}"] * (n > 1), *strip_nproc(argv)])
        write_out_file(args.markdown, markdown_report(rows, command, machine))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
