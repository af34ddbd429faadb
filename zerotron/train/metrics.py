"""Metrics: peak FLOP/s measurement, MFU, the metrics.jsonl writer and the loss plot."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch


def measure_peak_flops(device: torch.device, n: int = 1024, iters: int = 5, dtype=torch.float32,
                       budget_s: float = 0.0) -> float:
    """Measured matmul peak of this process in FLOP/s: best of ``iters`` (n x n) @ (n x n) products
    (after one untimed warm-up), each 2 n^3 FLOPs; with ``budget_s > 0`` trials go on until that many
    seconds have passed (at least ``iters``). On CPU this is the denominator of MFU (no datasheet
    peak is assumed). The best, not the mean, is kept: other processes on the cores only slow a trial."""
    gen = torch.Generator(device=device).manual_seed(0)  # never touch the training RNG streams
    a = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32, generator=gen).to(dtype)
    best, start, i = float("inf"), time.perf_counter(), 0
    while i < iters + 1 or time.perf_counter() - start < budget_s:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        (a @ b).sum().item()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # trial 0 warms up (allocations, thread pool, kernels)
            best = min(best, time.perf_counter() - t)
        i += 1
    return 2 * n**3 / best


TRAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
_PEAK_CACHE: dict[tuple, tuple[float, str]] = {}  # (device, dtype, threads) -> (FLOP/s, source)


def datasheet_peak(device: torch.device, dtype) -> float | None:
    """Dense bf16 datasheet peak FLOP/s of a known GPU (``analysis.hardware.GPUS``: H100, H200,
    A100) for ``dtype`` bfloat16 on CUDA; None otherwise (fp32 peaks depend on TF32 settings)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    from ..analysis.hardware import GPUS

    name = torch.cuda.get_device_name(device).lower()
    return next((g["peak_flops"] for key, g in GPUS.items() if key in name), None)


def peak_flops(device: torch.device, dtype=torch.float32, refresh: bool = False) -> tuple[float, str]:
    """Peak FLOP/s of one device and where it comes from: ``(flops, "datasheet <gpu>")`` on a known
    GPU in bf16, else ``(flops, "measured")``: best of >= 8 matmul trials over >= 0.3 s (CPU:
    1024^2, 2 GFLOP each, ~15 ms on a free core; GPU: 4096^2 and 8192^2). Cached per process by (device, dtype,
    intra-op threads): a process that builds many trainers measures once. ``refresh=True``
    measures again and keeps the larger of the old and new values."""
    key = (str(device), str(dtype), torch.get_num_threads())
    if key in _PEAK_CACHE and not refresh:
        return _PEAK_CACHE[key]
    sheet = datasheet_peak(device, dtype)
    if sheet is not None:
        _PEAK_CACHE[key] = (sheet, f"datasheet {torch.cuda.get_device_name(device)}")
        return _PEAK_CACHE[key]
    sizes = (4096, 8192) if device.type == "cuda" else (1024,)
    got = max(measure_peak_flops(device, n, iters=8, dtype=dtype, budget_s=0.3) for n in sizes)
    _PEAK_CACHE[key] = (max(got, _PEAK_CACHE.get(key, (0.0, ""))[0]), "measured")
    return _PEAK_CACHE[key]


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops_total: float) -> float:
    """Model FLOPs utilisation = tokens/s x training FLOPs per token / peak FLOP/s of all devices.
    FLOPs per token ~ 6N + 12 L C S (PaLM, Chowdhery et al. 2022, appendix B)."""
    return tokens_per_s * flops_per_token / peak_flops_total if peak_flops_total > 0 else 0.0


class MFUMeter:
    """``meter(tokens_per_s) -> {"mfu", "tflops_per_device", "peak_tflops_per_device"}`` for a run on ``world`` devices.

    achieved FLOP/s per device = tokens/s x ``flops_per_token`` / world (model FLOPs: recomputation
    of activation checkpointing is not counted); MFU = that / ``peak_per_device`` (the mean of the
    ranks' peaks). An MFU above 1 means the peak was under-measured (the cores were busy while it
    ran): the first time, the meter re-measures this process's peak (``peak_flops(refresh=True)``),
    raises ``peak_per_device`` to it and prints one warning on stderr (``warn=True``: rank 0)."""

    def __init__(self, flops_per_token: float, world: int, peak_per_device: float, device, dtype,
                 warn: bool = True, source: str = "measured"):
        self.flops_per_token, self.world, self.peak_per_device = flops_per_token, world, peak_per_device
        self.device, self.dtype, self.warn, self.source, self.remeasured = device, dtype, warn, source, False

    def __call__(self, tokens_per_s: float) -> dict:
        achieved = tokens_per_s * self.flops_per_token / self.world
        m = achieved / self.peak_per_device if self.peak_per_device > 0 else 0.0
        if m > 1 and not self.remeasured:
            self.remeasured, old = True, self.peak_per_device
            if self.source == "measured":
                self.peak_per_device = max(old, peak_flops(self.device, self.dtype, refresh=True)[0])
            m2 = achieved / self.peak_per_device
            if self.warn:
                import sys

                print(f"zerotron: warning: MFU {m:.3f} > 1 (achieved {achieved / 1e12:.4g} TFLOP/s per device, peak "
                      f"{old / 1e12:.4g} {self.source}); peak re-measured: {self.peak_per_device / 1e12:.4g} TFLOP/s, "
                      f"MFU {m2:.3f}{' (still > 1: the peak is an underestimate)' if m2 > 1 else ''}",
                      file=sys.stderr, flush=True)
            m = m2
        return {"mfu": m, "tflops_per_device": achieved / 1e12, "peak_tflops_per_device": self.peak_per_device / 1e12}


def _prefix_bytes(raw: bytes, n: int, last_step: int) -> int | None:
    """Byte length of the first ``n`` records of ``raw`` (blank lines included) when they all have
    ``step <= last_step`` and end with a newline; None otherwise."""
    end = seen = 0
    for line in raw.splitlines(keepends=True):
        if seen == n:
            break
        if line.strip():
            try:
                if json.loads(line).get("step", 0) > last_step:
                    return None
            except (ValueError, AttributeError):
                return None
            seen += 1
        end += len(line)
    return end if seen == n and raw[:end].endswith(b"\n") or end == 0 else None


class MetricsWriteError(OSError):
    """Appending to metrics.jsonl failed (disk full, I/O error); nothing torn was left, and the
    records are held by the writer (:attr:`MetricsWriter.held_steps`) for the next try."""


class MetricsWriter:
    """Append one JSON object per optimizer step to ``<run-dir>/metrics.jsonl`` (rank 0 only).

    Floats are written with full precision (``json`` uses repr). On resume from step ``k`` the
    lines with ``step > k`` (written after that checkpoint by a run that then died) are dropped.
    A failed append (ENOSPC, EIO, ...) is cut back to the file's previous length, so the file only
    ever holds whole lines; the records not written are held in memory, in order, and written
    before the next record (:meth:`write`, :meth:`retry`, :meth:`close`)."""

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path, warn=True) if r.get("step", 0) <= resume_step]
            end = _prefix_bytes(self.path.read_bytes(), len(kept), resume_step)
            if end is not None:  # the kept records are the file's first lines: cut in place (needs no space)
                os.truncate(self.path, end)
            else:
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                tmp.replace(self.path)  # atomic: a crash here leaves the old file or the new one
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._held: list[tuple[int, bytes]] = []  # (step, line) not yet written
        self._last: tuple[int, dict] | None = None  # (file offset, record) of the newest record written
        self._pending_last: dict = {}  # the newest record passed to write()

    @property
    def held_steps(self) -> list[int]:
        """Steps of the records not yet written (oldest first)."""
        return [s for s, _ in self._held]

    def write(self, record: dict) -> None:
        """Append ``record`` (after any held ones) as one line; NaN/inf become null (strict JSON).
        Raises MetricsWriteError, keeping the record held, if the append fails."""
        self._held.append((record.get("step", 0), (json.dumps(strict_json(record)) + "\n").encode()))
        self._pending_last = dict(record)
        self.retry()

    def amend(self, extra: dict) -> None:
        """Add the fields of ``extra`` to the newest record (e.g. ``ckpt_blocked_s``, known only
        after the step's checkpoint): a held record is changed in memory, a written one is cut
        off the file's end and appended again with the fields added (the file only ever holds
        whole lines; a failed rewrite holds the amended record, as :meth:`write` does). Raises
        MetricsWriteError like :meth:`write`; no-op before the first record."""
        if self._held:
            step, _ = self._held[-1]
            self._pending_last = {**self._pending_last, **extra}
            self._held[-1] = (step, (json.dumps(strict_json(self._pending_last)) + "\n").encode())
            return
        if self._last is None:
            return
        start, record = self._last
        os.ftruncate(self._fd, start)
        self.write({**record, **extra})

    def retry(self) -> None:
        """Write the held records in one append. Raises MetricsWriteError (they stay held) if it
        fails; the file is then truncated back to its length before the attempt."""
        if not self._held:
            return
        data = memoryview(b"".join(line for _, line in self._held))
        start = os.fstat(self._fd).st_size
        last_start = start + sum(len(line) for _, line in self._held[:-1])
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as e:
            try:
                os.ftruncate(self._fd, start)  # no torn line: back to whole records
            except OSError:
                pass  # read_metrics still drops a torn *last* line on resume
            steps = self.held_steps
            span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            err = MetricsWriteError(f"cannot append {span} to {self.path}: {e.strerror or type(e).__name__}")
            err.errno = e.errno
            raise err from None
        self._held.clear()
        self._last = (last_start, self._pending_last)

    def close(self) -> None:
        """Write the held records (MetricsWriteError if that fails; the file is closed either way)."""
        try:
            self.retry()
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


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
    naming the file and line for an unreadable line elsewhere, or the byte where it is not UTF-8."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:  # the records are ASCII (json.dumps): damaged bytes
        raise ValueError(f"{str(path)!r} is not UTF-8 text (byte {e.start}); restore it from a backup or "
                         "remove it") from None
    out = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            out.append(json.loads(ln))
        except ValueError:
            if any(x.strip() for x in lines[i + 1:]):
                raise ValueError(f"{str(path)!r} line {i + 1} is not JSON (only a torn last line is dropped); "
                                 "repair or remove that line") from None
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
