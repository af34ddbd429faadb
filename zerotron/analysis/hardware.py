"""Hardware profiles of the planner (:mod:`zerotron.analysis.planner`): datasheet GPUs, measured
CPU profiles, and calibration from a ``zerotron bench comm --json`` file.

A collective follows the alpha-beta (latency-bandwidth) model of Hockney (1994), as used by
Thakur, Rabenseifner & Gropp (2005) for MPI collectives: a call moving nccl-tests size X bytes on n
ranks takes ``alpha + X * factor(op, n) / busbw`` seconds, with the bus-bandwidth factor of
NVIDIA nccl-tests (doc/PERFORMANCE.md): 2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter, 1 for point-to-point. :func:`fit_alpha_beta` recovers (alpha, busbw) per op from
the times a ``bench comm`` run measured over its message sizes.

Elementwise work (layer norm, GELU, residual adds, softmax / cross-entropy) is priced separately
from matmuls at ``vector_rate`` element passes per second (a roofline's memory-bound side,
Williams et al. 2009): on a GPU one pass reads and writes one bf16 element, so the datasheet
default is HBM bandwidth / 4 bytes; on a CPU it is measured (:func:`measure_vector_rate`).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace

GB = 10**9
OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
# Datasheet numbers: dense bf16 peak FLOP/s; HBM bytes/s; NVLink bytes/s per direction (H100/H200
# NVLink4 900 GB/s, A100 NVLink3 600 GB/s, both directions); one 400 Gb/s (NDR) / 200 Gb/s (HDR)
# NIC per GPU. Latencies are assumptions of the order of NCCL's small-message times (calibrate
# them with `zerotron bench comm`).
GPUS = {
    "h100": dict(peak_flops=989e12, memory=80 * GB, hbm=3.35e12, nvlink=450e9, network=50e9),
    "h200": dict(peak_flops=989e12, memory=141 * GB, hbm=4.8e12, nvlink=450e9, network=50e9),
    "a100": dict(peak_flops=312e12, memory=80 * GB, hbm=2.039e12, nvlink=300e9, network=25e9),
}
INTRA_LATENCY_S = 10e-6
# The host link a device's offload traffic crosses, bytes/s per direction (datasheets): PCIe Gen4 x16
# 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s, Gen5 x16 63 GB/s; NVLink-C2C (Grace Hopper) 900 GB/s in
# both directions, 450 GB/s each way. Offload priced by the planner crosses it (``--host-link``).
HOST_LINKS = {"pcie4": 31.5e9, "pcie5": 63e9, "nvlink-c2c": 450e9}
_MAX_GBPS = 1e6  # a busbw above 1 PB/s in a calibration file is an error, not a measurement
INTER_LATENCY_S = 20e-6


@dataclass(frozen=True)
class Hardware:
    """One device type and its links.

    ``peak_flops`` FLOP/s and ``memory`` bytes per device; ``intra`` / ``inter``: achievable busbw
    (bytes/s) per op (``OPS``) on the intra-node and inter-node links; ``latency_intra`` /
    ``latency_inter``: the alpha (seconds per call) per op; ``vector_rate``: elementwise element
    passes per second; ``overlap``: the fraction of an asynchronous data-parallel collective that
    hides behind compute (``bench comm``'s overlap test; 0 = none, the conservative default);
    ``sync_penalty``: seconds a blocking collective costs on top of ``latency`` when it follows
    compute (``bench comm``'s "after_compute" all-reduce minus its back-to-back time; 0 on GPUs,
    where NCCL has its own stream; on an oversubscribed CPU the communication threads first wait
    for a core)."""
    name: str
    peak_flops: float
    memory: int
    intra: dict = field(hash=False)
    inter: dict = field(hash=False)
    latency_intra: dict = field(default_factory=lambda: dict.fromkeys(OPS, INTRA_LATENCY_S), hash=False)
    latency_inter: dict = field(default_factory=lambda: dict.fromkeys(OPS, INTER_LATENCY_S), hash=False)
    vector_rate: float = GPUS["h100"]["hbm"] / 4
    overlap: float = 0.0
    sync_penalty: float = 0.0


def hardware(gpu: str = "h100", comm_eff: float = 0.8) -> Hardware:
    """Datasheet :class:`Hardware` of ``gpu`` (a key of ``GPUS``), bandwidths x ``comm_eff``,
    vector rate = HBM bytes/s / 4 (one bf16 read + one bf16 write per element pass).
    Raises ValueError for an unknown GPU or comm_eff not in (0, 1]."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if not 0 < comm_eff <= 1:
        raise ValueError(f"comm efficiency must be in (0, 1], got {comm_eff}")
    g = GPUS[gpu]
    return Hardware(gpu, g["peak_flops"], g["memory"], {op: g["nvlink"] * comm_eff for op in OPS},
                    {op: g["network"] * comm_eff for op in OPS}, vector_rate=g["hbm"] / 4)


def custom_hardware(name: str, peak_flops: float, memory: int, busbw: float, vector_rate: float | None = None,
                    latency: float = 0.0) -> Hardware:
    """:class:`Hardware` not in ``GPUS`` (e.g. "cpu": a *measured* per-process matmul peak, RAM):
    ``peak_flops`` FLOP/s and ``memory`` bytes per device, ``busbw`` bytes/s and ``latency``
    seconds for every op on both links (refine the intra-node ones with :func:`calibrate`),
    ``vector_rate`` element passes/s (default: peak_flops / 100). Raises ValueError unless
    peak_flops, memory, busbw and vector_rate are > 0 and latency >= 0."""
    vector_rate = peak_flops / 100 if vector_rate is None else vector_rate
    if not (peak_flops > 0 and memory > 0 and busbw > 0 and vector_rate > 0 and latency >= 0):
        raise ValueError(f"peak_flops, memory, busbw and vector_rate must be > 0 and latency >= 0, got "
                         f"{peak_flops}, {memory}, {busbw}, {vector_rate}, {latency}")
    return Hardware(name, float(peak_flops), int(memory), dict.fromkeys(OPS, float(busbw)),
                    dict.fromkeys(OPS, float(busbw)), dict.fromkeys(OPS, float(latency)),
                    dict.fromkeys(OPS, float(latency)), float(vector_rate))


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` (``OPS``) on ``n`` ranks (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}.get(op, (n - 1) / n)


def collective_time(nbytes: float, op: str, n: int, bw: dict, latency: dict, calls: float = 1) -> float:
    """Seconds of ``calls`` calls of ``op`` that move ``nbytes`` (nccl-tests size) *in total* on
    ``n`` ranks: ``calls * alpha + nbytes * factor / busbw`` (alpha-beta model); 0 for n = 1."""
    return 0.0 if n <= 1 or calls <= 0 else calls * latency[op] + nbytes * busbw_factor(op, n) / bw[op]


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(alpha seconds, busbw bytes/s)`` of ``t = alpha + x / busbw`` fitted to ``(x, t)`` points
    (x = bytes x busbw factor, t seconds) by least squares on the *relative* error, so small and
    large messages weigh alike; alpha is clipped at 0 (then refitted through the origin).
    Raises ValueError for no point, a non-positive x or t, or a non-increasing time."""
    pts = [(float(x), float(t)) for x, t in points]
    if not pts or any(x <= 0 or t <= 0 for x, t in pts):
        raise ValueError(f"need points with positive bytes and times, got {points!r}")
    if len({x for x, _ in pts}) == 1:  # one size: no latency can be told apart
        x, t = pts[0]
        return 0.0, x / t
    # minimise sum((alpha/t + gamma*x/t - 1)^2): 2x2 normal equations in (alpha, gamma)
    uu = sum(1 / t**2 for _, t in pts)
    uv = sum(x / t**2 for x, t in pts)
    vv = sum((x / t) ** 2 for x, t in pts)
    u1, v1 = sum(1 / t for _, t in pts), sum(x / t for x, t in pts)
    det = uu * vv - uv * uv
    alpha, gamma = ((vv * u1 - uv * v1) / det, (uu * v1 - uv * u1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0:
        alpha, gamma = 0.0, v1 / vv
    if gamma <= 0:
        raise ValueError("the measured times do not grow with the message size: no bandwidth to fit")
    return alpha, 1 / gamma


def calibrate(hw: Hardware, bench: dict) -> Hardware:
    """``hw`` with its intra-node link replaced, op by op, by what ``bench`` (a ``zerotron bench
    comm --json`` dict) measured: with blocking times at two or more sizes, (alpha, busbw) from
    :func:`fit_alpha_beta`; otherwise busbw = the measured busbw at the largest size (blocking
    preferred) and alpha unchanged. Ops the file lacks take the all-reduce's values when it has
    one (else the datasheet's). Results of a ``--topology`` run carry a ``scope``: ``intra`` (and
    results without a scope) calibrate the intra-node link, ``inter`` the inter-node link the same
    way, ``world`` none; without inter results the inter-node link is left as it was. The overlap fraction becomes the measured
    ``overlap.hidden_fraction`` and ``sync_penalty`` the median extra time of the "after_compute"
    all-reduces over the blocking ones, when present. Raises ValueError if ``bench`` has no usable result."""
    results = bench.get("results", []) if isinstance(bench, dict) else []
    results = [r for r in results if isinstance(r, dict)] if isinstance(results, list) else []
    intra = _fit_link([r for r in results if r.get("scope", "intra") == "intra"], hw.intra, hw.latency_intra)
    if intra is None:
        raise ValueError("calibration file has no busbw results for any of " + ", ".join(OPS))
    inter = _fit_link([r for r in results if r.get("scope") == "inter"], hw.inter, hw.latency_inter)
    inter_bw, inter_lat = inter or (hw.inter, hw.latency_inter)
    ov = bench["overlap"].get("hidden_fraction") if isinstance(bench.get("overlap"), dict) else None
    overlap = min(1.0, max(0.0, float(ov))) if _num(ov) is not None else hw.overlap
    return replace(hw, intra=intra[0], latency_intra=intra[1], inter=inter_bw, latency_inter=inter_lat,
                   overlap=overlap, sync_penalty=_sync_penalty(bench, hw.sync_penalty))


def _fit_link(results: list[dict], base_bw: dict, base_lat: dict) -> tuple[dict, dict] | None:
    """``(busbw, latency)`` per op of one link from ``bench comm`` results (see :func:`calibrate`),
    starting from ``base_bw`` / ``base_lat``; None when no result is usable."""
    best, pts = {}, {}
    for r in results:
        if not (r.get("op") in OPS and _pos(r.get("busbw_GBps")) and r["busbw_GBps"] < _MAX_GBPS):
            continue
        op, blocking = r["op"], r.get("mode", "blocking") == "blocking"
        key = (blocking, _pos(r.get("bytes")) or 0.0)
        if op not in best or key > best[op][0]:
            best[op] = (key, r["busbw_GBps"] * 1e9)
        if blocking and all(_pos(r.get(k)) for k in ("time_s", "bytes", "algbw_GBps")):
            pts.setdefault(op, []).append((r["bytes"] * r["busbw_GBps"] / r["algbw_GBps"], r["time_s"]))
    if not best:
        return None
    bw, lat = dict(base_bw), dict(base_lat)
    for op, (_, b) in best.items():
        bw[op] = b
        if len({x for x, _ in pts.get(op, [])}) >= 2:
            try:
                lat[op], bw[op] = fit_alpha_beta(pts[op])
            except ValueError:  # times that do not grow with size: keep the largest size's busbw
                pass
    if "all_reduce" in best:  # ops the file lacks: the all-reduce's link, not the datasheet's
        for op in OPS:
            if op not in best:
                bw[op], lat[op] = bw["all_reduce"], lat["all_reduce"]
    return bw, lat


def _num(x) -> float | None:
    """``x`` as a finite float (not a bool), else None."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _pos(x) -> float | None:
    """``x`` as a finite float > 0, else None."""
    v = _num(x)
    return v if v is not None and v > 0 else None


def _sync_penalty(bench: dict, default: float) -> float:
    """Median over sizes of (after_compute - blocking) all-reduce seconds in a ``bench comm``
    dict, clipped at 0; ``default`` without after_compute results."""
    t = {}
    for r in bench["results"]:
        if isinstance(r, dict) and r.get("op") == "all_reduce" and _pos(r.get("time_s")) and _pos(r.get("bytes")):
            t.setdefault(r["bytes"], {})[r.get("mode", "blocking")] = r["time_s"]
    d = sorted(max(0.0, v["after_compute"] - v["blocking"]) for v in t.values()
               if "after_compute" in v and "blocking" in v)
    return (d[len(d) // 2] + d[(len(d) - 1) // 2]) / 2 if d else default


def measure_vector_rate(rows: int = 1024, ffn: int = 512, vocab: int = 4096, iters: int = 5) -> float:
    """Element passes per second of this process on CPU, measured on a GPT's two largest
    elementwise ops at its own sizes: GELU over (rows, ffn) and log-softmax over (rows, vocab),
    each forward + backward (2 passes per element) on float32; rows = micro-batch x sequence
    length, ffn = 4 x n_embd. Returns total passes / total median seconds over ``iters`` runs."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    passes, seconds = 0, 0.0
    for fn, cols in ((F.gelu, ffn), (lambda t: F.log_softmax(t, -1), vocab)):
        x = torch.randn(rows, cols, generator=gen, requires_grad=True)
        g = torch.randn(rows, cols, generator=gen)
        ts = []
        for _ in range(iters + 1):
            t = time.perf_counter()
            fn(x).backward(g)
            ts.append(time.perf_counter() - t)
            x.grad = None
        passes, seconds = passes + 2 * rows * cols, seconds + statistics.median(ts[1:])
    return passes / seconds
