"""The cliff beaten: flat ZeRO-3 / ZeRO-2 / DDP / FSDP2 against HSDP / hierarchical DDP on the
two-node harness with a shaped link (root needed): benchmarks/hsdp_two_nodes.{json,md,png}.

Usage: ``python benchmarks/hsdp_two_nodes.py [--rate 200mbit] [--rounds 3]`` (runs the harness,
about 5 minutes on the shared 2-core machine: ``bench train`` of 8 layouts, then a short
``bench comm`` for the intra-/inter-node busbw), or ``--md-only`` to rewrite the markdown from the
JSON (``--plan-only``: rerun ``bench plan`` on the committed JSON). Cross-node bytes per step are the veth tx_bytes counters of both nodes over the timed steps
(``bench train``'s ``link_tx_bytes_per_step``); the theory they are compared with is
:func:`theory_link_bytes` (``zerotron/parallel/data/hsdp.py`` derives it)."""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYOUTS = "zero3,hsdp-zero3,zero2,hsdp-zero2,dp,dp-hier,fsdp2-zero3,fsdp2-hsdp"
# communication-bound on purpose: ~3.3 M parameters, 1 sequence of 64 tokens per rank per step
OVERRIDES = ["--model.n_embd", "256", "--train.global_batch", "4", "--train.micro_batch", "1"]
PAIRS = (("zero3", "hsdp-zero3"), ("zero2", "hsdp-zero2"), ("dp", "dp-hier"), ("fsdp2-zero3", "fsdp2-hsdp"))
NODES, PER_NODE = 2, 2


def unit_params() -> tuple[int, int]:
    """(root, blocks) parameter counts of the benchmark model: embeddings + final norm (+ the tied
    head), and the transformer blocks (the ZeRO units)."""
    import torch

    from zerotron.config import load_config
    from zerotron.models.registry import build_model
    from zerotron.train.setup import gpt_config

    cfg = load_config(str(ROOT / "configs" / "tiny.toml"), [(k[2:], v) for k, v in zip(OVERRIDES[::2], OVERRIDES[1::2])])
    torch.manual_seed(0)
    model = build_model(gpt_config(cfg, cfg.data.vocab_size))
    blocks = sum(p.numel() for b in model.blocks() for p in b.parameters())
    return model.num_params() - blocks, blocks


KIND = {"zero3": "zero3", "fsdp2-zero3": "zero3", "zero2": "zero2", "dp": "ddp", "hsdp-zero3": "hsdp_zero",
        "hsdp-zero2": "hsdp_zero", "fsdp2-hsdp": "hsdp_zero", "dp-hier": "hier_ddp"}


def theory_link_bytes(layout: str, root: int, blocks: int, e: int = 4) -> float:
    """Cross-node bytes per step of a bench layout on 2 nodes x 2 ranks, one micro-batch
    (:func:`zerotron.parallel.data.hsdp.cross_node_bytes`, whose docstring derives it)."""
    from zerotron.parallel.data.hsdp import cross_node_bytes

    return cross_node_bytes(KIND[layout], root, blocks, NODES, PER_NODE, e)


def markdown(d: dict) -> str:
    rows = {r["layout"]: r for r in d["train"]["rows"]}
    root, blocks = d["params"]["root"], d["params"]["blocks"]
    lines = [f"# The cliff beaten: HSDP vs flat sharding across two nodes (gloo, {d['rate']} link)", "",
             "Two network namespaces joined by a veth pair (`zerotron/testing_netns.py`), the link shaped with",
             f"`tc ... tbf rate {d['rate']}` both ways, 2 gloo ranks per node, on the shared 2-core machine (other",
             "engineers' jobs ran at the same time: absolute figures are noisy, the paired per-round ratios less so).",
             "", "```bash", f"python benchmarks/hsdp_two_nodes.py --rate {d['rate']} --rounds {d['rounds']}",
             f"# = python -m zerotron.testing_netns --rate {d['rate']} -- bench train --config configs/tiny.toml \\",
             f"#     --layouts {LAYOUTS} \\", f"#     --steps {d['steps']} --warmup 1 --rounds {d['rounds']} "
             + " ".join(OVERRIDES), "```", "",
             f"Communication-bound setting: {root + blocks:,} parameters (fp32; {blocks:,} in the 4 blocks), one "
             "sequence of 64 tokens per rank per step, so a step is mostly the gradients and parameters moving. "
             "HSDP = `parallel.dp_replicate = 2`: the shard group is each node's 2 ranks, the replicate group "
             f"pairs local rank j of both nodes. {d['wall_s']:.0f} s wall for the whole run.", "",
             "| flat | hierarchical | tokens/s flat | tokens/s hier. | paired ratio (target ≥ 1.3 for ZeRO-3) | "
             "link bytes/step flat | link bytes/step hier. | hier./flat (target ≤ 0.6) | flat measured/theory | "
             "hier. measured/theory |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for flat, hier in PAIRS:
        f, h = rows.get(flat), rows.get(hier)
        if not f or not h or f.get("skipped") or h.get("skipped"):
            lines.append(f"| {flat} | {hier} | skipped: {(f or h or {}).get('error', 'missing')[:120]} |" + " |" * 7)
            continue
        tf, th = theory_link_bytes(flat, root, blocks), theory_link_bytes(hier, root, blocks)
        lf, lh = f["link_tx_bytes_per_step"], h["link_tx_bytes_per_step"]
        lines.append(f"| {flat} | {hier} | {f['tokens_per_s']:,.0f} | {h['tokens_per_s']:,.0f} | "
                     f"**{h['ratio_vs_flat']:.2f}×** | {lf:,.0f} | {lh:,.0f} | **{lh / lf:.3f}** | "
                     f"{lf / tf:.3f} | {lh / th:.3f} |")
    c = d.get("comm") or {}
    lines += ["", "tokens/s: median over rounds; paired ratio: median over rounds of tokens/s(hier.) / "
              "tokens/s(flat) of the same round (`bench train`'s `vs flat`). link bytes/step: the veth "
              "`tx_bytes` counters of both nodes over the timed steps / steps (median over rounds), TCP/IP "
              "headers included. Theory (`cross_node_bytes` in "
              "`zerotron/parallel/data/hsdp.py`): with Psi parameters of e = 4 bytes, a flat 4-rank ring "
              "crosses the link on one edge each way; HSDP sends one all-reduce of each 1/S gradient shard "
              "across the nodes, **2 Psi e per step** in all (Psi e each way); flat ZeRO-3 two all-gathers and "
              "one reduce-scatter, **1.5 (2 Psi_blocks + Psi_root) e + 3 Psi e** (gloo's reduce-scatter moves "
              "an all-reduce's bytes), flat ZeRO-2 4.5 Psi e, flat DDP 3 Psi e.", ""]
    if c.get("cliff"):
        lines += ["## Link speeds measured in the same harness (`bench comm`, busbw)", "",
                  "| op | size | intra-node GB/s | inter-node GB/s | cliff |", "|---|---|---:|---:|---:|"]
        for x in c["cliff"]:
            lines.append(f"| {x['op']} | {x['bytes'] / 2**20:g} MiB | {x['intra_busbw_GBps']:.3f} | "
                         f"{x['inter_busbw_GBps']:.4f} | {x['ratio']:.0f}× |")
        lines.append("")
    pj = HERE / "hsdp_two_nodes_plan.json"
    if pj.exists():
        pl = json.loads(pj.read_text())
        lines += ["## The planner on this run (`zerotron bench plan`)", "",
                  f"Spearman rank correlation of predicted vs measured tokens/s over the {len(pl['layouts'])} layouts: "
                  f"**{pl['spearman']:.3f}** (the four hierarchical layouts first and the flat ZeRO-3 ones last in both); the planner "
                  "prices the shard-group collectives on the intra-node link and the replicas' all-reduce on the "
                  "inter-node one, both fitted to this run's `bench comm` (`benchmarks/hsdp_two_nodes_plan.md`).", ""]
    lines += ["## All layouts (`bench train` table)", "", d["train"]["table"], "",
              "Plot: `benchmarks/hsdp_two_nodes.png` (tokens/s per layout).", ""]
    return "\n".join(lines)


def plan(a) -> None:
    """``zerotron bench plan`` on this run: the planner's predicted tokens/s of every layout (the
    inter-node link calibrated from the run's ``bench comm`` inter results) against the measured,
    Spearman rank correlation -> benchmarks/hsdp_two_nodes_plan.{md,json}."""
    subprocess.run([sys.executable, "-m", "zerotron", "bench", "plan", "--bench-train",
                    "benchmarks/hsdp_two_nodes_train.json", "--bench-comm", "benchmarks/hsdp_two_nodes_comm.json",
                    "--config", "benchmarks/hsdp_two_nodes.toml", "--threads", "1",
                    "--out", "benchmarks/hsdp_two_nodes_plan.md", "--json", "benchmarks/hsdp_two_nodes_plan.json"],
                   cwd=ROOT, check=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="200mbit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--md-only", action="store_true")
    p.add_argument("--plan-only", action="store_true", help="rerun only bench plan on the committed JSON")
    a = p.parse_args()
    out = HERE / "hsdp_two_nodes.json"
    if a.plan_only:
        plan(a)
    elif not a.md_only:
        from zerotron.bench.report import format_table

        t0 = time.monotonic()
        tj, cj = str(HERE / "hsdp_two_nodes_train.json"), str(HERE / "hsdp_two_nodes_comm.json")
        cmd = [sys.executable, "-m", "zerotron.testing_netns", "--rate", a.rate, "--timeout", "540", "--", "bench",
               "train", "--config", "configs/tiny.toml", "--layouts", LAYOUTS, "--steps", str(a.steps), "--warmup",
               "1", "--rounds", str(a.rounds), "--json", tj, "--plot", str(HERE / "hsdp_two_nodes.png"), *OVERRIDES]
        r = subprocess.run(cmd, cwd=ROOT)
        if r.returncode:
            return r.returncode
        r = subprocess.run([sys.executable, "-m", "zerotron.testing_netns", "--rate", a.rate, "--timeout", "200", "--",
                            "bench", "comm", "--ops", "all_reduce,all_gather", "--sizes", "1MiB:4MiB", "--iters", "4",
                            "--warmup", "1", "--time-budget", "40", "--json", cj], cwd=ROOT)
        comm = json.loads(Path(cj).read_text()) if r.returncode == 0 else None
        train = json.loads(Path(tj).read_text())
        rows = train["rows"] if isinstance(train, dict) and "rows" in train else train
        root, blocks = unit_params()
        d = {"rate": a.rate, "rounds": a.rounds, "steps": a.steps, "wall_s": time.monotonic() - t0,
             "params": {"root": root, "blocks": blocks},
             "train": {"rows": rows, "table": format_table(rows)},
             "theory_link_bytes": {n: theory_link_bytes(n, root, blocks) for pair in PAIRS for n in pair},
             "comm": {"cliff": comm.get("cliff"), "results": comm.get("results")} if comm else None}
        out.write_text(json.dumps(d, indent=1))
        plan(a)
    d = json.loads(out.read_text())
    (HERE / "hsdp_two_nodes.md").write_text(markdown(d))
    print((HERE / "hsdp_two_nodes.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
