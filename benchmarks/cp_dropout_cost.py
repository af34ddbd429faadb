"""The cost of attention dropout under context parallelism, and the ring's hidden transfer fraction
per rank.

Ring attention forward + backward on 2 cp ranks at seq 4,096 (the shape of
``benchmarks/context_cpu_4096.md``: batch 1, 8 query heads on 2 kv heads, head dim 32, fp32), with
dropout 0 (blocks on torch's fused CPU flash kernel) and with dropout 0.1 (coordinate-function
masks, ``zerotron.models.attn_dropout``: blocks in plain torch, the mask hashed per block in the
forward and again in the backward). Per rank: block-compute seconds, transfer waits, and the hidden
fraction 1 - wait / transfers-alone (``zerotron.bench.context.rank_attention_times``).

Usage: ``python benchmarks/cp_dropout_cost.py [--seq 4096] [--repeats 3] [--json OUT]``. Timings
from a loaded shared machine are not speed results; the idle-machine figure is the one to quote.
"""
from __future__ import annotations

import argparse
import json

from zerotron.bench.context import attention_balance


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    rows = {}
    for dropout in (0.0, 0.1):
        res = attention_balance(2, a.seq, ("zigzag",), heads=8, kv_heads=2, head_dim=32, repeats=a.repeats,
                                dropout=dropout)["zigzag"]
        rows[dropout] = res["ranks"]
        for r in res["ranks"]:
            print(f"dropout {dropout}: rank {r['rank']} compute {r['compute_s']:.3f} s (min {r['compute_min_s']:.3f}), "
                  f"wait {r['wait_s']:.4f} s, transfers alone {r['transfer_s']:.4f} s, "
                  f"hidden fraction {r['hidden_fraction']:.3f}")
    ratio = [d["compute_min_s"] / z["compute_min_s"] for d, z in zip(rows[0.1], rows[0.0])]
    print("dropout 0.1 / dropout 0 block compute (least disturbed iteration) per rank:",
          ", ".join(f"{x:.2f}" for x in ratio))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"seq": a.seq, "rows": {str(k): v for k, v in rows.items()}, "ratio": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
