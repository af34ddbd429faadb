"""Peak RSS of one rank's model construction (build + ``parallelize``) with real tensors, on torch's
fake process group (rank R of N: collectives return at once), with ``train.meta_init`` on or off.

    python benchmarks/meta_init_rss.py --world 8 --rank 0 --meta true  --model.preset llama3-8b --parallel.tp 8
    python benchmarks/meta_init_rss.py ... --meta false      # every rank builds the dense model first

Prints one JSON line: world, rank, meta, rss_before_bytes (RSS right before the construction),
rss_peak_bytes (the peak RSS during it: VmHWM reset through /proc/self/clear_refs first, so what the
process reached earlier -- imports, a cold data cache, the plan -- does not mask it), params_bytes
(what the strategy holds), wall_s.
"""
from __future__ import annotations

import json
import resource
import sys
import time


def _status(key: str) -> int:
    """Bytes of ``key`` (VmRSS, VmHWM) in /proc/self/status."""
    import re

    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_hwm() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0, /proc/self/clear_refs
    "5"), after returning freed heap to the kernel; False where that is not possible."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--meta", choices=("true", "false"), default="true")
    p.add_argument("--config", default="configs/dryrun_llama3_8b.toml")
    args, rest = p.parse_known_args(argv)
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zerotron.parallel  # noqa: F401  (imported by build_rank: its modules' memory is not the model's)
    import zerotron.train.optim  # noqa: F401
    from zerotron.analysis.dryrun import build_rank
    from zerotron.config import load_config, parse_overrides
    from zerotron.distributed.mesh import Mesh
    from zerotron.plan import build_plan

    cfg = load_config(args.config, parse_overrides(rest + ["--train.meta_init", args.meta]))
    plan = build_plan(cfg, args.world)
    dist.init_process_group("fake", rank=args.rank, world_size=args.world, store=FakeStore())
    mesh = Mesh(plan.dims, torch.device("cpu"))
    before = _status("VmRSS")
    hwm_reset = _reset_hwm()  # the peak from here on (else the process-lifetime peak: imports, data, plan)
    t0 = time.perf_counter()
    _, strategy, _ = build_rank(cfg, plan, mesh)
    wall = time.perf_counter() - t0
    peak = _status("VmHWM") if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(q.numel() * q.element_size() for q in {id(x): x for x in strategy.module.parameters()}.values()
               if q.untyped_storage().nbytes())
    zero = getattr(strategy, "zero", None) or strategy
    held += sum(f.full.untyped_storage().nbytes() + f.master.untyped_storage().nbytes()
                for f in getattr(zero, "all_flats", []) if not f.aliased)
    print(json.dumps({"world": args.world, "rank": args.rank, "meta": args.meta == "true", "rss_before_bytes": before,
                      "rss_peak_bytes": peak, "params_bytes": held, "wall_s": wall}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
