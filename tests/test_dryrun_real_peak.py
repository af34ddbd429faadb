"""A dry run's peak per rank against the real run's (issue 33): the bytes the CPU allocator held at
the peak of the same step of a real 2-rank gloo run (``bench.step_memory.measure_step_memory``:
``torch.profiler``'s allocation records, no tracker) against the dry run's MemTracker peak of that
rank (fake tensors, fake process group), for DDP and native ZeRO-1 (configs/tiny.toml, fp32).

Tolerance, derived: the real rank also holds the int64 token ids of its micro-batches (x and y: 16
bytes per token; the dry run makes them as real tensors outside its fake mode, so its tracker does
not count them) -- added to the dry figure -- and a few small tensors alive or not depending on
timing (0-dim results of the real ``.item()`` reads and of the bookkeeping all-reduces still
referenced by gloo works: 4-8 bytes each; -8 to +208 bytes measured over 8 runs), so 512 bytes
either way (the token ids alone are 4,096: leaving them out fails). DDP meets it on every rank. Native
ZeRO-1 does in most runs, but a real rank sometimes holds more at the step's start, peak or end
(0 to 147,976 bytes over 6 runs of the same code, 475,752 at the end of a step in one CI run, so
timing-dependent: an asynchronous gloo collective's buffer kept beyond the fake backend's instant
completion; not isolated, and no bound on it is derived): for ZeRO-1 the test asserts the model
states equal and the real figures never below the dry run's (less than 512 bytes under), the excess
reported, not bounded. The
other layouts of ``benchmarks/dryrun_vs_real.py`` (ZeRO-3, FSDP2, tp, pp) differ by more
(README, "Dry run vs the real run's allocator") and are not asserted here.
"""
import pytest

from zerotron.testing import run_ranks, tiny_config

WORLD = 2
BASE = {"train.micro_batch": 2, "train.global_batch": 8}
LAYOUTS = {"ddp-dp2": {"parallel.dp": 2}, "zero1-dp2": {"parallel.dp": 2, "parallel.zero_stage": 1}}
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
    ids = 16 * (cfg.train.global_batch // WORLD) * cfg.model.block_size  # this rank's x and y, int64
    for rec in dry_run(cfg, WORLD, ranks=list(range(WORLD))):
        got = real[rec["rank"]][name]
        assert got["model_state_bytes"] == rec["model_state_bytes"], (name, rec["rank"])
        for what, dry, meas in (("peak", rec["peak_bytes_traced"], got["peak_bytes_measured"]),
                                ("start", rec["held_at_step_start"], got["held_at_step_start"]),
                                ("end", rec["end_of_step"]["total"], got["end_of_step"])):
            assert meas - dry - ids >= -SCALARS, (name, rec["rank"], what, meas, dry)
            if name == "ddp-dp2":  # exact up to the timing of 0-dim tensors (module docstring)
                assert meas - dry - ids <= SCALARS, (name, rec["rank"], what, meas, dry)
            else:
                report(f"dry vs real allocator, {name} rank {rec['rank']} {what}: real - dry - ids = "
                       f"{meas - dry - ids:,} B (timing-dependent, not bounded)")

