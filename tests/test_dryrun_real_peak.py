"""A dry run's peak per rank against the real run's (issue 33): the bytes the CPU allocator held at
the start, peak and end of the same step of a real 2-rank gloo run
(``bench.step_memory.measure_step_memory``: ``torch.profiler``'s allocation records, no tracker)
against the dry run's MemTracker figures of that rank (fake tensors, fake process group), for DDP,
native ZeRO-1 and ZeRO-3, FSDP2, tp 2 (configs/tiny.toml, fp32) and native ZeRO-3 in bf16 with full
recomputation (``parallel.backend = gloo`` so the dry run takes gloo's code paths); and the step's
collectives, per (op, group, tag), calls and bytes, against ``comm.STATS`` of the real run.

What the real figure leaves out, and why (``bench.step_memory``'s docstring has the evidence): gloo's
own staging buffers and kernels' workspaces (bf16 matmuls' oneDNN scratch, freed inside the op;
both counted apart), and blocks whose free runs on a gloo worker thread, which the profiler does not
report (counted as freed when the worker's run of their collective ends). Before the first two
corrections the real run held 43-662 KB more than the dry run, varying run to run.

Tolerance, derived: the real rank also holds the int64 token ids of its micro-batches (x and y: 16
bytes per token; the dry run makes them as real tensors outside its fake mode, so its tracker does
not count them) -- added to the dry figure -- and 0-dim tensors alive or not by timing (the real
``.item()`` reads, bookkeeping all-reduces: 4-8 bytes each; -8 to +208 bytes measured), so 512
bytes either way. Seen red (code broken on purpose, this file run): with the unseen frees left in,
ZeRO-1 rank 0 +201,600 at a step's end; with gloo's staging counted, ZeRO-3 +108,024 at the peak;
with the workspaces counted, ZeRO-3 bf16 full +66,680 at the peak (both ranks).
Before the fixes of this file's commits, in ``benchmarks/dryrun_vs_real.py``: without the token-id
term -4,096 and more; without the tp RNG states in the dry run, tp +10,112 at start, peak and end.
"""
import pytest

from zerotron.bench.step_memory import traced_comm
from zerotron.testing import run_ranks, tiny_config

WORLD = 2
BASE = {"train.micro_batch": 2, "train.global_batch": 8, "parallel.backend": "gloo"}
DP = {"parallel.dp": 2}
LAYOUTS = {"ddp-dp2": DP, "zero1-dp2": {**DP, "parallel.zero_stage": 1},
           "zero3-dp2": {**DP, "parallel.zero_stage": 3},
           "fsdp2-dp2": {**DP, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"},
           "tp2": {"parallel.tp": 2},
           "zero3-dp2-bf16-full": {**DP, "parallel.zero_stage": 3, "train.dtype": "bf16",
                                   "train.activation_checkpointing": "full"}}
SCALARS = 512  # bytes: small tensors of the real step alive or not by timing (module docstring)


def _measure(layouts: dict) -> dict:
    from zerotron.bench.step_memory import measure_step_memory

    return {name: measure_step_memory(tiny_config({**BASE, **ov})) for name, ov in layouts.items()}


@pytest.fixture(scope="module")
def real():
    return run_ranks(_measure, WORLD, LAYOUTS, join_timeout_s=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_peak_equals_the_real_allocator(name, real, report):
    from zerotron.analysis.dryrun import dry_run

    cfg = tiny_config({**BASE, **LAYOUTS[name]})
    dp = WORLD // cfg.parallel.tp
    ids = 16 * (cfg.train.global_batch // dp) * cfg.model.block_size  # this rank's x and y, int64
    # traced once: dp ranks hold equal shards, and tp ranks equal ones here (tp 2 divides the
    # vocabulary, so neither holds the loss's padding column)
    rec = dry_run(cfg, WORLD, ranks=[0])[0]
    for rank in range(WORLD):
        got = real[rank][name]
        assert got["model_state_bytes"] == rec["model_state_bytes"], (name, rank)
        assert got["comm"] == traced_comm(rec), (name, rank)
        for what, d, meas in (("peak", rec["peak_bytes_traced"], got["peak_bytes_measured"]),
                              ("start", rec["held_at_step_start"], got["held_at_step_start"]),
                              ("end", rec["end_of_step"]["total"], got["end_of_step"])):
            assert abs(meas - d - ids) <= SCALARS, (name, rank, what, meas, d, ids)
        u = got["unseen_frees"]
        report(f"dry vs real allocator, {name} rank {rank}: peak real - dry - ids = "
               f"{got['peak_bytes_measured'] - rec['peak_bytes_traced'] - ids:,} B; gloo's own buffers "
               f"{got['backend_peak_bytes']:,} B; kernels' workspaces {got['workspace_peak_bytes']:,} B; frees on gloo workers {u['count']} ({u['bytes']:,} B)")
