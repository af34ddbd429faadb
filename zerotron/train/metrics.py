"""Metrics: peak FLOP/s measurement, MFU, the metrics.jsonl writer and the loss plot."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch


def measure_peak_flops(device: torch.device, n: int = 1024, iters: int = 5, dtype=torch.float32) -> float:
    """Measured matmul peak of this process in FLOP/s: best of ``iters`` (n x n) @ (n x n) products,
    each 2 n^3 FLOPs. On CPU this is the denominator of MFU (no datasheet peak is assumed)."""
    gen = torch.Generator(device=device).manual_seed(0)  # never touch the training RNG streams
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    best = float("inf")
    for _ in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        (a @ b).sum().item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation = tokens/s x training FLOPs per token / peak FLOP/s of all devices.
    FLOPs per token ~ 6N + 12 L C S (PaLM, Chowdhery et al. 2022, appendix B)."""
    return tokens_per_s * flops_per_token / peak_flops_total if peak_flops_total > 0 else 0.0


class MetricsWriter:
    """Append one JSON object per optimizer step to ``<run-dir>/metrics.jsonl`` (rank 0 only).

    Floats are written with full precision (``json`` uses repr). On resume from step ``k`` the
    lines with ``step > k`` (written after that checkpoint by a run that then died) are dropped."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path, warn=True) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(self.path)  # atomic: a crash here leaves the old file or the new one
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._f = open(self.path, "a")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(strict_json(record)) + "\n")  # NaN/inf -> null (strict JSON)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def strict_json(obj):
    """``obj`` with every non-finite float replaced by None (strict JSON: no NaN/Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def read_metrics(path: str | Path, warn: bool = False) -> list[dict]:
    """All records of a metrics.jsonl file. A torn *last* line (the process died, or the disk
    filled, while writing it) is dropped, with a warning on stderr if ``warn``. Raises ValueError
    naming the file and line for an unreadable line elsewhere."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            out.append(json.loads(ln))
        except ValueError:
            if any(x.strip() for x in lines[i + 1:]):
                raise ValueError(f"{str(path)!r} line {i + 1} is not JSON; repair or remove that line") from None
            if warn:
                print(f"zerotron: warning: dropped the torn last line {i + 1} of {path} ({len(ln)} characters, "
                      "not valid JSON)", file=sys.stderr, flush=True)
    return out


def plot_losses(metrics_path: str | Path, out_png: str | Path) -> None:
    """Train loss (per step) and validation loss (evaluation steps) vs step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    nan = float("nan")
    ax.plot([r["step"] for r in recs], [nan if r["loss"] is None else r["loss"] for r in recs], label="train", lw=1)
    val = [r for r in recs if r.get("val_loss") is not None]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
