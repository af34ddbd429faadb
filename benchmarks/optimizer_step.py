"""The optimizer step alone (``train.optimizer_impl``): seconds per AdamW step of the default model's
parameters, fused vs foreach vs loop, paired per round (the order rotates), in this process.

Usage: ``python benchmarks/optimizer_step.py [--preset tiny|small] [--rounds 6] [--steps 20]
[--dtype fp32|fp64] [--json F] [--markdown F]``. Two parameter sets: the model's parameters as the
plain runner and DDP step them (two groups, decay / no decay, as ``parallel.optim.build_optimizer``
builds them), and the same values as two flat buffers (what native ZeRO steps on one rank). The
gradients are fixed random tensors. Also reports the largest difference of each implementation
from the loop after the timed steps, in ulps of each tensor's largest value (expected: a few)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from zerotron.config_sections import TrainConfig
from zerotron.models import registry
from zerotron.parallel.optim import IMPLS, build_optimizer, decay_mask


def _params(preset: str, dtype, flat: bool):
    torch.manual_seed(0)
    cfg = registry.preset_config(preset) if preset != "default" else registry.preset_config(
        "tiny", n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=4096)
    model = registry.build_model(cfg).to(dtype)
    mask = decay_mask(model)
    ps = list(model.parameters())
    if flat:  # two flat buffers (decay / no decay), as ZeRO's master shards
        groups = [[p for p in ps if mask[id(p)]], [p for p in ps if not mask[id(p)]]]
        flats = [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in g])) for g in groups if g]
        mask = {id(f): i == 0 for i, f in enumerate(flats)}
        ps = flats
    g = torch.Generator().manual_seed(1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype) * 1e-2
    return ps, mask


def _run(impl: str, preset: str, dtype, flat: bool, steps: int):
    ps, mask = _params(preset, dtype, flat)
    opt = build_optimizer(ps, mask, TrainConfig(optimizer_impl=impl))
    opt.step()  # state created, warm caches
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        opt.step()
    wall, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
    return wall, cpu, [p.detach().clone() for p in ps]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "fp64"))
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    dtype = torch.float64 if args.dtype == "fp64" else torch.float32
    rows = []
    for flat in (False, True):
        wall = {i: [] for i in IMPLS}
        cpu = {i: [] for i in IMPLS}
        finals = {}
        for r in range(args.rounds):
            order = IMPLS[r % 3:] + IMPLS[:r % 3]
            for impl in order:
                w, c, final = _run(impl, args.preset, dtype, flat, args.steps)
                wall[impl].append(w)
                cpu[impl].append(c)
                finals[impl] = final
        eps = torch.finfo(dtype).eps
        for impl in IMPLS:
            ulps = max(float((a - b).abs().max() / (b.abs().max() * eps))  # per tensor, of its largest value
                       for a, b in zip(finals[impl], finals["loop"]))
            rows.append({"params": "flat (ZeRO)" if flat else "per parameter", "impl": impl,
                         "wall_ms_median": 1e3 * statistics.median(wall[impl]),
                         "cpu_ms_median": 1e3 * statistics.median(cpu[impl]),
                         "wall_ratio_vs_loop": statistics.median(a / b for a, b in zip(wall[impl], wall["loop"])),
                         "cpu_ratio_vs_loop": statistics.median(a / b for a, b in zip(cpu[impl], cpu["loop"])),
                         "max_ulps_vs_loop": ulps})
    machine = (f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads, "
               f"load average {os.getloadavg()[0]:.1f}")
    head = "| parameters | impl | wall ms/step | CPU ms/step | wall / loop | CPU / loop | max ulps vs loop |\n|---|---|---|---|---|---|---|"
    lines = [head] + [f"| {r['params']} | {r['impl']} | {r['wall_ms_median']:.2f} | {r['cpu_ms_median']:.2f} | "
                      f"{r['wall_ratio_vs_loop']:.2f} | {r['cpu_ratio_vs_loop']:.2f} | {r['max_ulps_vs_loop']:.1f} |"
                      for r in rows]
    table = "\n".join(lines) + "\n"
    print(machine)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(f"# AdamW step: fused vs foreach vs loop\n\n`python benchmarks/optimizer_step.py "
                                       f"--preset {args.preset} --rounds {args.rounds} --steps {args.steps} --dtype "
                                       f"{args.dtype}`\n\n{machine}; medians of paired rounds (order rotated).\n\n{table}")


if __name__ == "__main__":
    main()
