"""Load balance of ring attention (issue 28): per-rank attention time, forward + backward, under the
zigzag split and under the plain contiguous split, and how much of the ring's transfer time its
compute hides; and ``zerotron bench context``, a sequence-length sweep of context parallelism
against data parallelism (:func:`main`).

Method. Each cp rank builds random q, k, v of its T/cp tokens (``batch``, ``heads``, ``kv_heads``,
``head_dim``, ``dtype``), runs ``warmup`` untimed iterations of
:func:`zerotron.parallel.context.ring.ring_attention` forward + backward, then ``repeats`` timed
ones. Per iteration it records the block-compute seconds the ring reports (``timings``: the
attention a rank does itself, waits excluded), the seconds spent waiting for transfers, and the
wall time of the iteration (which a synchronous ring evens out: a rank with less work waits for its
peers, so the wall time cannot show the imbalance; the compute time does). Each rank's figure is
the median over the timed iterations. Imbalance = max / min of the ranks' compute times (1.0 is
perfect balance). Ranks run with one intra-op thread each (``zerotron.testing.run_ranks``): an idle
machine with a core per rank gives the clean figure.

Hidden transfer fraction. One forward + backward of ring attention on cp ranks moves ``3 cp - 2``
messages of one K/V block each, (2, batch, kv_heads, T/cp, head_dim) (forward: cp - 1 K/V hops;
backward: cp - 1 K/V hops and cp hops of the K/V gradient accumulators, in the compute dtype).
``transfer_s`` = that count x the median seconds of one such hop done alone (send to the next rank,
receive from the previous, waited at once, no compute running: :func:`ring_hop_seconds`).
``wait_s`` = the seconds the ring waited for its transfers in the iteration (forward + backward,
what ``ring_attention(timings=...)`` reports). Hidden fraction = ``1 - wait_s / transfer_s``: 1 when
every transfer finished behind the compute, 0 when the ring waited as long as the transfers take
alone. That raw figure (``hidden_fraction_raw``) can fall below 0: a wait also holds the time a
slower peer needs to post its send (imbalance, a loaded machine). So the ring also records when
every hop was posted and when every wait began and ended (``ring_attention(timings=...)``'s
``events``, one monotonic clock for the processes of a host), and :func:`exposed_transfer`
counts of each wait only the part after both peers of the hop had posted it (the previous rank its
send, the next rank its receive): ``hidden_fraction = 1 - exposed_s / transfer_s``, what the
transfers themselves were not hidden, the peer's lateness set apart (``late_s``), as the pipeline
executor's idle split does (wait for sender vs transfer).

``zerotron bench context [--nproc 2] [--config F] [--seq 256,512] [--layouts cp-ring,dp,cp-a2a]
[--steps K] [--warmup W] [--rounds R] [--repeats N] [--balance] [--json OUT] [--section.field V ...]``:
for each length, ``model.block_size = seq`` and every layout runs as in ``zerotron bench train``
(:func:`zerotron.bench.train.run_benchmark`: same global batch for all, tokens/s of the whole
global batch, peak memory max over ranks), with paired ratios between the layouts of that length, and memory per rank three ways: the peak
(``peak_mem_bytes``), the peak above the floor the layout started from (``peak_above_floor_bytes``:
the resident set right after the peak reset, before the model is built: interpreter, libraries,
corpus, process-group buffers, which no estimator models) and the estimators' model states +
activations (:func:`memory_estimate`);
then ring attention at the model's attention shape (micro-batch, heads, kv heads, head dim) on
all ``nproc`` ranks as one cp group gives the hidden transfer fraction, and ``--balance`` adds the
zigzag vs contiguous balance (:func:`balance_summary`); with ``--model.dropout P`` that ring
timing runs attention dropout with the coordinate mask (plain-torch blocks), so two sweeps give the
cost of dropout under cp. A command of its own rather than ``bench
train --seq``: bench train compares layouts at one config, while this sweep changes the model
shape per row and adds kernel timings that are not training layouts.
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["attention_balance", "balance_summary", "exposed_transfer", "rank_attention_times", "ring_hop_seconds",
           "main"]


def exposed_transfer(events: list[dict], rank: int) -> tuple[float, float]:
    """``(exposed_s, late_s)`` of cp rank ``rank``'s waits in one ring attention call, from every
    rank's ``events`` (index = cp rank; each ``{"posts": [t], "waits": [(hop, start, end)]}`` as
    ``ring_attention(timings=...)`` records them; hop i of every rank is the same step of the same
    code path). A wait on hop i covers this rank's send to the next rank (complete once that rank
    posted its receive, its own hop i) and its receive from the previous rank (posted as that rank's
    hop i): of ``[start, end]``, the part before ``max(prev's post, next's post)`` is the peers'
    lateness (``late_s``), the rest transfer not hidden behind compute (``exposed_s``). Seconds;
    both 0 for one rank."""
    n = len(events)
    prev, nxt = events[(rank - 1) % n]["posts"], events[(rank + 1) % n]["posts"]
    exposed = late = 0.0
    for hop, start, end in events[rank]["waits"]:
        ready = max(start, prev[hop], nxt[hop])
        exposed += max(0.0, end - ready)
        late += min(end, ready) - start
    return exposed, late


def ring_hop_seconds(group, shape, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Median seconds of one ring hop alone on the cp ``group`` (all ranks call it): post the send
    of a ``shape`` tensor to the next rank and the receive from the previous, wait for both, nothing
    else running (a barrier before each). Tag ``cp_hop`` in ``comm.STATS``."""
    from zerotron.distributed import comm
    from zerotron.distributed.groups import group_ranks, process_group

    pg = process_group(group)
    cp, rank = group.size(), group.rank()
    ranks = group_ranks(group) or list(range(cp))
    x, times = torch.zeros(shape, dtype=dtype), []
    for _ in range(repeats + 1):  # the first is a warm-up (connection set-up)
        comm.barrier(pg)
        t0 = time.perf_counter()
        buf = torch.empty_like(x)
        for w in comm.batch_isend_irecv([("send", x, ranks[(rank + 1) % cp]), ("recv", buf, ranks[(rank - 1) % cp])],
                                        group=group, tag="cp_hop"):
            w.wait()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def rank_attention_times(group, seq_len: int, layout: str = "zigzag", *, batch: int = 1, heads: int = 8,
                         kv_heads: int | None = None, head_dim: int = 64, dtype: torch.dtype = torch.float32,
                         repeats: int = 5, warmup: int = 1, seed: int = 0, dropout: float = 0.0) -> dict:
    """On one rank of the cp ``group`` (all ranks call it): time ring attention forward + backward
    of a local (batch, heads, seq_len/cp, head_dim) block (module doc). Returns a dict of medians
    over ``repeats`` iterations, in seconds: ``compute_s`` (forward + backward block compute;
    ``compute_min_s`` its minimum, the least disturbed on a shared machine),
    ``forward_compute_s``, ``backward_compute_s``, ``wait_s`` (transfer waits), ``wall_s``;
    plus ``rank`` (in the group), ``layout`` and ``work_blocks`` (``ring.rank_work``: the
    computed score blocks, the expected time ratio between ranks), ``transfer_s`` (the iteration's
    3 cp - 2 hops timed alone, :func:`ring_hop_seconds`) and ``hidden_fraction`` = 1 - wait_s /
    transfer_s (module doc). ``dropout`` > 0: attention dropout with the coordinate mask
    (``models.attn_dropout``; its blocks run plain torch, not the fused kernel), to measure that
    cost. Raises ValueError as ring_attention does."""
    from zerotron.distributed import comm
    from zerotron.distributed.groups import process_group
    from zerotron.models.attn_dropout import AttnDropout
    from zerotron.parallel.context.ring import rank_work, ring_attention

    cp, rank = group.size(), group.rank()
    t = seq_len // cp
    gen = torch.Generator().manual_seed(seed + rank)
    q = torch.randn(batch, heads, t, head_dim, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(batch, kv_heads or heads, t, head_dim, generator=gen).to(dtype).requires_grad_()
            for _ in range(2))
    dout = torch.randn(batch, heads, t, head_dim, generator=gen).to(dtype)
    cdt = torch.promote_types(dtype, torch.float32)
    block = (2, batch, kv_heads or heads, t, head_dim)
    hop_kv = ring_hop_seconds(group, block, dtype, repeats)
    hop_dkv = hop_kv if cdt == dtype else ring_hop_seconds(group, block, cdt, repeats)
    transfer = 2 * (cp - 1) * hop_kv + cp * hop_dkv
    rows = []
    for i in range(warmup + repeats):
        comm.barrier(process_group(group))
        timings: dict = {}
        t0 = time.perf_counter()
        drop = AttnDropout(dropout, 12345 + i) if dropout > 0 else None
        ring_attention(q, k, v, group, layout=layout, timings=timings, drop=drop).backward(dout)
        wall = time.perf_counter() - t0
        if i >= warmup:
            rows.append(dict(timings, wall_s=wall))
    everyone = comm.all_gather_object([r.pop("events") for r in rows], group)  # [rank][iteration]
    split = [exposed_transfer([per[i] for per in everyone], rank) for i in range(len(rows))]
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    compute = [r["forward_compute_s"] + r["backward_compute_s"] for r in rows]
    wait = med["forward_wait_s"] + med["backward_wait_s"]
    exposed, late = statistics.median(e for e, _ in split), statistics.median(lt for _, lt in split)
    return {"rank": rank, "layout": layout, "work_blocks": rank_work(layout, cp, rank), "dropout": dropout,
            "compute_s": statistics.median(compute), "compute_min_s": min(compute),
            "forward_compute_s": med["forward_compute_s"], "backward_compute_s": med["backward_compute_s"],
            "wait_s": wait, "wall_s": med["wall_s"], "transfer_s": transfer, "exposed_s": exposed, "late_s": late,
            "hidden_fraction": 1 - exposed / transfer if transfer > 0 else None,
            "hidden_fraction_raw": 1 - wait / transfer if transfer > 0 else None}


def _ranks(seq_len, layouts, kwargs):
    import torch.distributed as dist

    from zerotron.distributed.comm import NamedGroup

    group = NamedGroup(dist.group.WORLD, "cp")
    return {layout: rank_attention_times(group, seq_len, layout, **kwargs) for layout in layouts}


def attention_balance(cp: int, seq_len: int, layouts=("zigzag", "contiguous"), **kwargs) -> dict:
    """Spawn ``cp`` local gloo ranks and measure :func:`rank_attention_times` for each layout
    (keyword arguments passed on). Returns ``{layout: {"ranks": [per-rank dict, ...], "imbalance":
    max/min compute_s over ranks, "imbalance_min": the same of compute_min_s, "work_imbalance":
    max/min of work_blocks}}``. Raises RuntimeError if a rank fails."""
    from zerotron.testing import run_ranks

    return balance_summary(run_ranks(_ranks, cp, seq_len, tuple(layouts), kwargs, timeout_s=600), layouts)


def balance_summary(per_rank: list[dict], layouts) -> dict:
    """``per_rank[r][layout]``: rank r's :func:`rank_attention_times` of each layout -> what
    :func:`attention_balance` returns."""
    out = {}
    for layout in layouts:
        ranks = [r[layout] for r in per_rank]
        times = [r["compute_s"] for r in ranks]
        best = [r["compute_min_s"] for r in ranks]
        work = [r["work_blocks"] for r in ranks]
        out[layout] = {"ranks": ranks, "imbalance": max(times) / min(times), "imbalance_min": max(best) / min(best),
                       "work_imbalance": max(work) / min(work)}
    return out


DEFAULT_LAYOUTS = "cp-ring,dp,cp-a2a"


def _parser():
    from zerotron.cli_help import HelpFormatter, OneLineErrorParser

    from .train import DEFAULT_CONFIG

    p = OneLineErrorParser(prog="zerotron bench context", allow_abbrev=False, formatter_class=HelpFormatter,
                           description="Sequence-length sweep of context parallelism: for each --seq, 'bench train' of "
                           "--layouts at model.block_size = seq (same global batch), the ring's hidden transfer "
                           "fraction at the model's attention shape, and with --balance the per-rank attention time "
                           "under the zigzag and contiguous splits; --section.field VALUE overrides a config field.")
    p.add_argument("--nproc", type=int, default=2, help="local worker processes (the ring timing runs at cp = nproc)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="TOML config")
    p.add_argument("--seq", default="256,512", help="comma list of sequence lengths (model.block_size)")
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help="bench train layouts run at each length")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per layout and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before timing")
    p.add_argument("--rounds", type=int, default=2, help="rounds; the layout order rotates every round")
    p.add_argument("--repeats", type=int, default=3, help="timed ring attention iterations per length")
    p.add_argument("--balance", action="store_true", help="also time each rank's attention, zigzag vs contiguous split")
    p.add_argument("--exact-memory", action="store_true",
                   help="CPU: fix glibc's mmap threshold (bench.train.exact_cpu_memory) so peak RSS follows the "
                        "live tensor bytes, not the heap's high-water mark; slower: its tokens/s are not comparable")
    p.add_argument("--json", help="write the rows here (rank 0)")
    return p


def _attention_shape(cfg, vocab: int) -> dict:
    """rank_attention_times keywords of the model's attention at ``cfg``: batch = train.micro_batch,
    heads, kv_heads, head_dim = n_embd / n_head, float32 (float64 under train.dtype fp64)."""
    from zerotron.train.setup import gpt_config

    m = gpt_config(cfg, vocab)
    return {"batch": cfg.train.micro_batch, "heads": m.n_head, "kv_heads": getattr(m, "n_kv_head", None) or m.n_head,
            "head_dim": m.n_embd // m.n_head, "dtype": torch.float64 if cfg.train.dtype == "fp64" else torch.float32}


def memory_estimate(path, overrides, name: str, world: int, num_params: int, vocab: int) -> dict | None:
    """The estimators' bytes per rank for layout ``name`` of ``zerotron bench train`` at ``overrides``
    on ``world`` ranks: model states (:func:`zerotron.analysis.memory.model_state_bytes`, sharded over
    dp x cp) + activations of one micro-batch of seq/cp tokens
    (:func:`zerotron.analysis.activations.activation_bytes`: torch's CPU SDPA runs its flash kernel
    without dropout, which saves what ring attention saves: q, k, v, output, log-sum-exp). Returns
    ``{"estimate_states_bytes", "estimate_activation_bytes", "estimate_bytes"}``, or None for a
    layout outside that model (pipelines, fp64 training)."""
    from zerotron.analysis.activations import DTYPE_BYTES, activation_bytes
    from zerotron.analysis.memory import model_state_bytes
    from zerotron.config import load_config
    from zerotron.plan import build_plan
    from zerotron.train.setup import gpt_config

    from .layouts import get_layout

    layout = get_layout(name)
    cfg = load_config(path, [*overrides, *((k, str(v).format(world=world)) for k, v in layout.overrides.items())])
    plan, t = build_plan(cfg, layout.world or world), cfg.train
    act_dtype = {"fp32": "fp32", "bf16-mixed": "bf16"}.get(t.dtype)
    if plan.pp > 1 or act_dtype not in DTYPE_BYTES:
        return None
    m = gpt_config(cfg, vocab)
    act = activation_bytes(m, t.micro_batch, m.block_size // plan.cp, tp=plan.tp, sp=plan.sequence_parallel,
                           dtype=act_dtype, attention="math" if m.dropout > 0 else "flash",
                           recompute=t.activation_checkpointing)["max_bytes"]
    states = model_state_bytes(num_params, plan.dp * plan.cp, plan.zero_stage, t.dtype)["total_bytes"]
    return {"estimate_states_bytes": states, "estimate_activation_bytes": act, "estimate_bytes": states + act}


def sweep(path, overrides, seqs, names, steps, warmup, rounds, repeats, balance, dev, data,
          exact_memory: bool = False) -> list[dict]:
    """Collective over every rank: per length, the :func:`zerotron.bench.train.summarize` rows of
    ``names`` (``seq`` added), a ``"ring"`` row (per-rank ring timing on the whole world as the cp
    group: ``compute_s``, ``wait_s``, ``transfer_s``, ``hidden_fraction`` min over ranks, ``ranks``),
    and with ``balance`` a ``"balance"`` row (:func:`balance_summary` of zigzag and contiguous)."""
    import torch.distributed as dist

    from zerotron.config import load_config
    from zerotron.distributed import comm
    from zerotron.distributed.comm import NamedGroup

    from .report import paired_ratio, summarize
    from .train import exact_cpu_memory, run_benchmark

    group, rows = NamedGroup(dist.group.WORLD, "cp"), []
    exact = exact_memory and dev.type == "cpu" and exact_cpu_memory()
    for seq in seqs:
        over = [*overrides, ("model.block_size", str(seq))]
        layer = {r["layout"]: r for r in summarize(run_benchmark(path, over, names, steps, warmup, rounds, dev, data))}
        for r in layer.values():
            for base in names:
                if base != r["layout"] and not r.get("skipped") and not layer[base].get("skipped"):
                    r[f"ratio_vs_{base}"] = paired_ratio(r["tokens_per_s_rounds"], layer[base]["tokens_per_s_rounds"])
            est = None if r.get("skipped") else memory_estimate(path, over, r["layout"], r["world_size"],
                                                                 r["num_params"], data.vocab_size)
            rows.append({"seq": seq, "kind": "train", **r, **(est or {}), "exact_memory": exact})
        cfg = load_config(path, over)
        shape = _attention_shape(cfg, data.vocab_size)
        layouts = ("zigzag", "contiguous") if balance else ("zigzag",)
        mine = {lay: rank_attention_times(group, seq, lay, repeats=repeats, dropout=cfg.model.dropout, **shape)
                for lay in layouts}
        per_rank = comm.all_gather_object(mine)
        ring = [r["zigzag"] for r in per_rank]
        rows.append({"seq": seq, "kind": "ring", "layout": "ring-attention", "cp": len(ring), "dropout": cfg.model.dropout,
                     **{k: v for k, v in shape.items() if k != "dtype"}, "dtype": str(shape["dtype"]),
                     "compute_s": max(r["compute_s"] for r in ring), "wait_s": max(r["wait_s"] for r in ring),
                     "transfer_s": max(r["transfer_s"] for r in ring),
                     "exposed_s": max(r["exposed_s"] for r in ring), "late_s": max(r["late_s"] for r in ring),
                     "hidden_fraction": min(r["hidden_fraction"] for r in ring),
                     "hidden_fraction_raw": min(r["hidden_fraction_raw"] for r in ring), "ranks": ring})
        if balance:
            rows.append({"seq": seq, "kind": "balance", "layout": "ring-attention", "cp": len(ring),
                         **balance_summary(per_rank, layouts)})
    return rows


def format_rows(rows: list[dict]) -> str:
    """A markdown table of the sweep: one line per (seq, layout) and per ring/balance row."""
    out = ["| seq | layout | impl | tokens/s | peak mem MiB (max over ranks) | above floor MiB | estimate MiB "
           "| above floor / estimate | ratios |", "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    mib = 2 ** 20
    for r in rows:
        if r["kind"] == "train" and r.get("skipped"):
            out.append(f"| {r['seq']} | {r['layout']} | skipped: {r['error']} | | | | | | |")
        elif r["kind"] == "train":
            ratios = ", ".join(f"/{k[9:]} {v:.3f}" for k, v in r.items() if k.startswith("ratio_vs_") and v is not None)
            above, est = r.get("peak_above_floor_bytes"), r.get("estimate_bytes")
            mem = (f"{above / mib:,.0f} | {est / mib:,.0f} | {above / est:.3f}" if above is not None and est
                   else f"{above / mib:,.0f} | | " if above is not None else " | | ")
            out.append(f"| {r['seq']} | {r['layout']} | {r['impl']} | {r['tokens_per_s']:,.0f} | "
                       f"{r['peak_mem_bytes'] / mib:,.0f} | {mem} | {ratios} |")
    out.append("\n| seq | ring attention fwd+bwd: compute s | wait s | of which peers late s | exposed transfer s "
               "| transfer s (alone) | hidden fraction (min over ranks) | raw: 1 - wait / transfer |"
               "\n|---:|---:|---:|---:|---:|---:|---:|---:|")
    out += [f"| {r['seq']} | {r['compute_s']:.4f} | {r['wait_s']:.4f} | {r['late_s']:.4f} | {r['exposed_s']:.4f} | "
            f"{r['transfer_s']:.4f} | {r['hidden_fraction']:.3f} | {r['hidden_fraction_raw']:.3f} |"
            for r in rows if r["kind"] == "ring"]
    bal = [r for r in rows if r["kind"] == "balance"]
    if bal:
        out.append("\n| seq | split | compute imbalance (max/min over ranks) | of the least disturbed | work imbalance |"
                   "\n|---:|---|---:|---:|---:|")
        out += [f"| {r['seq']} | {lay} | {r[lay]['imbalance']:.3f} | {r[lay]['imbalance_min']:.3f} | "
                f"{r[lay]['work_imbalance']:.3f} |" for r in bal for lay in ("zigzag", "contiguous")]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zerotron bench context`` (module doc, :func:`sweep`); returns an exit code
    (2 for bad arguments or a refused config)."""
    import json
    import sys

    from ..out_files import check_out_files, write_out_file
    from .entry import prologue, run_body
    from .layouts import parse_layouts

    argv = list(sys.argv[1:] if argv is None else argv)

    def parse(argv):
        args, rest = _parser().parse_known_args(argv)
        check_out_files({"--json": args.json})
        args.names = parse_layouts(args.layouts)
        try:
            args.seqs = [int(x) for x in args.seq.split(",") if x.strip()]
        except ValueError:
            args.seqs = []
        if not args.seqs or min(args.seqs) < 1:
            raise ValueError(f"--seq must be a comma list of positive sequence lengths, got {args.seq!r}")
        if min(args.steps, args.rounds, args.repeats, args.nproc - 1) < 1 or args.warmup < 0:
            raise ValueError("--steps, --rounds and --repeats must be >= 1, --warmup >= 0 and --nproc >= 2 "
                             "(the ring needs 2 ranks)")
        return args, rest

    got = prologue("bench context", "zerotron.bench.context", argv, parse)
    if isinstance(got, int):
        return got
    args, overrides, cfg = got
    rank, n, dev, rows = run_body(cfg, lambda dev, data: sweep(
        args.config, overrides, args.seqs, args.names, args.steps, args.warmup, args.rounds, args.repeats,
        args.balance, dev, data, args.exact_memory))
    if rank == 0:
        print(f"zerotron bench context: {n} rank(s), {dev.type}, torch {torch.__version__}\n{format_rows(rows)}")
        if args.json:
            write_out_file(args.json, json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":  # python -m zerotron.bench.context (what --nproc launches)
    sys_exit = main()
    raise SystemExit(sys_exit)
