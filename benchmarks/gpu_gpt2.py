"""GPT-2 small (124M) on one GPU: training tokens/s and MFU against a measured bf16 matmul peak.

Run once on a GPU machine (defaults: preset gpt2, bf16 autocast, 16 x 1024 tokens per step,
300 timed steps after 20 warm-up steps)::

    python benchmarks/gpu_gpt2.py --out benchmarks/gpu_gpt2.json
    python benchmarks/gpu_gpt2.py --compile --out benchmarks/gpu_gpt2_compile.json

CPU smoke test (seconds)::

    python benchmarks/gpu_gpt2.py --device cpu --steps 3 --warmup 1 --preset tiny --batch 2 --out /tmp/g.json

What runs: zerotron's own single-device path (the one ``zerotron train`` takes on one process):
a world-size-1 process group, ``parallelize`` (native DDP over a 1-rank group), AdamW with the
GPT-2 decay mask, gradient clipping at 1.0, and ``train_step``. Data: uniform random token ids
(``--seed``), or windows of a zerotron token cache with ``--cache DIR`` (``<cache_dir>/<key>``).
Throughput numbers do not depend on the token values.

Numbers. tokens/s = batch x seq_len x steps / wall seconds of the timed steps (synchronised).
Training FLOPs/token = 6N + 12 L C S (PaLM, appendix B; ``zerotron.analysis.flops``). MFU =
tokens/s x FLOPs/token / peak FLOP/s, where the peak is *measured* here: the best of ``--peak-iters``
bf16 (n x n) @ (n x n) matmuls, 2 n^3 FLOPs each (``zerotron.train.metrics.measure_peak_flops``;
n = 8192 on GPU, 512 on CPU). ``--datasheet-tflops X`` adds an MFU against a vendor peak too.
Peak memory: ``torch.cuda.max_memory_allocated`` (bytes; not measured on CPU).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="gpt2", help="zerotron.models.gpt preset (gpt2 = 124M; tiny for smoke tests)")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--steps", type=int, default=300, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (compilation, allocator warm-up)")
    p.add_argument("--batch", type=int, default=16, help="sequences per optimizer step (one micro-batch)")
    p.add_argument("--seq", type=int, default=0, help="sequence length (0 = the preset's block_size)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="autocast dtype of the training step")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slow first steps)")
    p.add_argument("--cache", default="", help="a zerotron token cache directory to draw windows from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-n", type=int, default=0, help="matmul size of the peak measurement (0 = auto)")
    p.add_argument("--peak-iters", type=int, default=20)
    p.add_argument("--datasheet-tflops", type=float, default=0.0, help="vendor bf16 dense peak, TFLOP/s (optional)")
    p.add_argument("--out", default="", help="write the result as JSON here")
    return p.parse_args(argv)


def batches(args, vocab: int, seq: int, n: int):
    """``n`` (x, y) int64 pairs of shape (batch, seq): random ids, or windows of ``--cache``."""
    rng = np.random.default_rng(args.seed)
    if args.cache:
        from zerotron.data import batch_from_indices, load_token_data, num_windows

        data = load_token_data(args.cache)
        if data.vocab_size > vocab:
            sys.exit(f"--cache: vocabulary {data.vocab_size} > model vocabulary {vocab}")
        windows = num_windows(len(data.train), seq)
        return [batch_from_indices(data.train, rng.integers(0, windows, args.batch), seq) for _ in range(n)]
    out = []
    for _ in range(n):
        ids = torch.from_numpy(rng.integers(0, vocab, (args.batch, seq + 1), dtype=np.int64))
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from zerotron.analysis.flops import training_flops_per_token
    from zerotron.config import load_config
    from zerotron.distributed.mesh import Mesh, ParallelDims, destroy, init_distributed
    from zerotron.models.gpt import GPT, preset_config
    from zerotron.parallel import parallelize
    from zerotron.plan import ParallelPlan
    from zerotron.train.metrics import measure_peak_flops
    from zerotron.train.optim import build_scheduler, decay_mask
    from zerotron.train.step import train_step

    want = None if args.device == "auto" else torch.device(args.device)
    if want is not None and want.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: CUDA is not available")
    _, world, dev = init_distributed("auto", timeout_s=600, device=want)
    if world != 1:
        sys.exit("run this script as a single process")
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers (optimizer, LayerNorm) use TF32
    torch.backends.cudnn.allow_tf32 = True
    mcfg = preset_config(args.preset)
    seq = args.seq or mcfg.block_size
    if seq > mcfg.block_size:
        sys.exit(f"--seq {seq} exceeds the preset's block_size {mcfg.block_size}")
    cfg = load_config(None, [("train.dtype", args.dtype), ("train.global_batch", str(args.batch)),
                             ("train.micro_batch", str(args.batch)), ("train.steps", str(args.warmup + args.steps)),
                             ("train.lr", "6e-4"), ("train.min_lr", "6e-5"), ("train.warmup_steps", "10"),
                             ("train.grad_clip", "1.0")])
    torch.manual_seed(args.seed)
    model = GPT(mcfg).to(dev)
    mesh = Mesh(ParallelDims(1), dev)
    strategy = parallelize(model, ParallelPlan.from_config(cfg, mesh.dims), mesh)
    if args.compile:
        strategy.module = torch.compile(model)  # DataParallel calls self.module(x); hooks stay on the parameters
    opt = strategy.build_optimizer(cfg.train, decay_mask(model))
    sched = build_scheduler(opt, cfg.train)
    data = batches(args, mcfg.vocab_size, seq, args.warmup + args.steps)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    losses, times = [], []
    for i, mb in enumerate(data):
        if i == args.warmup:
            sync()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        out = train_step(strategy, opt, sched, [mb], mesh.group("dp"), cfg.train.grad_clip, args.dtype, dev)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
    sync()
    wall = time.perf_counter() - t_start
    tokens_per_s = args.batch * seq * args.steps / wall
    n_params = model.num_params()
    fpt = training_flops_per_token(n_params, mcfg.n_layer, mcfg.n_embd, seq)
    peak_n = args.peak_n or (8192 if dev.type == "cuda" else 512)
    peak_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak = measure_peak_flops(dev, n=peak_n, iters=args.peak_iters, dtype=peak_dtype)
    res = {
        "preset": args.preset, "n_params": n_params, "n_layer": mcfg.n_layer, "n_embd": mcfg.n_embd,
        "vocab_size": mcfg.vocab_size, "seq_len": seq, "batch": args.batch, "tokens_per_step": args.batch * seq,
        "dtype": args.dtype, "compile": args.compile, "data": args.cache or "random", "warmup": args.warmup,
        "steps": args.steps, "wall_s": wall, "tokens_per_s": tokens_per_s,
        "step_time_s_median": statistics.median(times), "flops_per_token": fpt,
        "achieved_tflops": tokens_per_s * fpt / 1e12, "peak_tflops_measured": peak / 1e12,
        "peak_matmul": f"{peak_n}x{peak_n} {str(peak_dtype).replace('torch.', '')}",
        "mfu_measured_peak": tokens_per_s * fpt / peak,
        "mfu_datasheet": tokens_per_s * fpt / (args.datasheet_tflops * 1e12) if args.datasheet_tflops else None,
        "peak_mem_bytes": int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None,
        "loss_first": losses[0], "loss_last": losses[-1], "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
    }
    destroy()
    print(markdown(res))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def markdown(r: dict) -> str:
    mem = "-" if r["peak_mem_bytes"] is None else f"{r['peak_mem_bytes'] / 2**30:.1f} GiB"
    ds = "" if r["mfu_datasheet"] is None else f" ({r['mfu_datasheet']:.1%} of the datasheet peak)"
    return "\n".join([
        f"## {r['preset']} ({r['n_params'] / 1e6:.1f}M params) on {r['device_name']} ({r['device']})", "",
        f"torch {r['torch']}, CUDA {r['cuda']}; {r['dtype']} autocast, compile={r['compile']}, data {r['data']}; "
        f"{r['batch']} x {r['seq_len']} = {r['tokens_per_step']:,} tokens/step; {r['steps']} timed steps after "
        f"{r['warmup']} warm-up", "",
        "| tokens/s | step ms (median) | FLOPs/token | achieved TFLOP/s | measured peak TFLOP/s | MFU | peak mem |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['tokens_per_s']:,.0f} | {r['step_time_s_median'] * 1e3:.1f} | {r['flops_per_token']:,} | "
        f"{r['achieved_tflops']:.2f} | {r['peak_tflops_measured']:.1f} ({r['peak_matmul']}) | "
        f"{r['mfu_measured_peak']:.1%}{ds} | {mem} |", "",
        f"loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}" + (
            f" (random tokens stay near ln(vocab) = {np.log(r['vocab_size']):.2f})" if r["data"] == "random" else "")])


if __name__ == "__main__":
    sys.exit(main())
