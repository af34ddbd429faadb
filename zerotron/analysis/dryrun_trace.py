"""One traced rank of a dry run (``analysis.dryrun``): the default process group replaced by the
fake backend as rank R of N, the rank built under ``FakeTensorMode`` with a MemTracker, two training
steps (the first creates the optimizer state, the second is measured: memory, collectives,
FLOPs)."""
from __future__ import annotations

import time
import warnings

import torch

from zerotron.analysis.dryrun_comm import code_paths_of, comm_by_group, p2p_completes_at_once
from zerotron.analysis.dryrun_memory import CATEGORIES, categories, categorize, not_dispatched, tracker_class
from zerotron.analysis.dryrun_rank import build_rank, largest_dense, model_config, rank_batches
from zerotron.analysis.trace_time import StepCounter
from zerotron.config_sections import Config


def traced_step(strategy, optimizer, batches, batch_group, tcfg, device, tracker) -> None:
    """``train.step.train_step`` without scheduler and guard: the token count all-reduce, then
    forward/backward, finish_grads, clip, loss reduction, optimizer step (``tracker.phase`` set
    before each)."""
    from zerotron.distributed import comm

    tracker.phase = "loss_norm"
    t = torch.tensor([float(sum(y.numel() for _, y in batches))], dtype=torch.float64)
    comm.all_reduce(t, group=batch_group, tag="loss_norm")
    n_global = int(sum(y.numel() for _, y in batches)) * max(1, batch_group.size() if batch_group else 1)
    tracker.phase = "zero_grad"
    strategy.zero_grad()
    tracker.phase = "forward_backward"
    loss_sum = strategy.forward_backward(batches, n_global, tcfg.dtype, device)
    tracker.phase = "finish_grads"
    strategy.finish_grads()
    tracker.phase = "clip_grad_norm"
    strategy.clip_grad_norm(tcfg.grad_clip)
    tracker.phase = "reduce_loss"
    strategy.reduce_loss(loss_sum)
    tracker.phase = "optimizer_step"
    strategy.optimizer_step(optimizer)


def trace_rank(cfg: Config, plan, rank: int, gpu_mem: int | None, steps: int = 2) -> dict:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from zerotron.distributed import comm
    from zerotron.distributed.mesh import Mesh

    dims = plan.dims
    t0 = time.perf_counter()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    tracker = tracker_class()(None)  # the limit applies from the measured step on
    try:
        device = torch.device("cpu")
        mesh = Mesh(dims, device)
        mcfg = model_config(cfg)
        batches = rank_batches(cfg, mesh, mcfg)
        backend = plan.backend if plan.backend != "auto" else "nccl"
        with warnings.catch_warnings(), p2p_completes_at_once(), code_paths_of(backend), \
                FakeTensorMode(allow_non_fake_inputs=True), tracker:
            # MemTracker's gradient hook meets parameters whose .grad the synchroniser cleared
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper")
            _, strategy, optimizer = build_rank(cfg, plan, mesh)
            setup = categories(tracker.get_tracker_snapshot("peak"))
            # with train.meta_init a real rank's construction holds what it keeps plus one full tensor
            held_after_setup = categories(tracker.get_tracker_snapshot("current"))["total"]
            largest = largest_dense(cfg)
            for i in range(steps):
                if i == steps - 1:  # the measured step: every state exists and is labelled
                    categorize(tracker, strategy, optimizer)
                    tracker._peak_mem = {}
                    tracker._peak_mem_snap = {}
                    tracker.peak_at, tracker.limit, tracker._last = None, gpu_mem, None
                    held = categories(tracker.get_tracker_snapshot("current"))
                    if gpu_mem is not None and held["total"] > gpu_mem:  # the states alone do not fit
                        tracker.oom = {"phase": "model states", "module": None, "pass": None, "total_bytes": held["total"],
                                       "category": max(CATEGORIES, key=lambda c: held[c]), "categories": held}
                    comm.STATS.reset()
                    with StepCounter() as counter:
                        traced_step(strategy, optimizer, batches, mesh.group("batch"), cfg.train, device, tracker)
                else:
                    traced_step(strategy, optimizer, batches, mesh.group("batch"), cfg.train, device, tracker)
            categorize(tracker, strategy, optimizer)
            peak = categories(tracker.get_tracker_snapshot("peak"))
            end = categories(tracker.get_tracker_snapshot("current"))
            states = strategy.model_state_bytes(optimizer)
            split = list(getattr(strategy, "split", None) or []) or None  # the pipeline runner's layers per stage
            for snap, key in ((peak, "total"), (end, "total")):  # what no operator made (see not_dispatched)
                snap["other"] += (extra := not_dispatched(strategy.module))
                snap[key] += extra
            held["total"] += extra
        traffic = comm_by_group(comm.STATS)
        coords = {k: v for k, v in mesh.coords.items()}
        members = {g: list(comm.STATS.members[g]) for g in traffic}
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "coords": coords, "peak_bytes_traced": peak["total"], "peak_traced": peak,
            "peak_at": tracker.peak_at, "end_of_step": end, "held_at_step_start": held["total"],
            "setup_peak_bytes": setup["total"],
            "model_state_bytes": states, "comm_traced": traffic,
            "comm_bytes_traced": {g: v["bytes"] for g, v in traffic.items()},
            "oom": tracker.oom, "layer_counts": split, "meta_init": bool(cfg.train.meta_init and not cfg.train.lora_rank),
            "construction_bytes": held_after_setup + largest, "group_members": members,
            "counts_traced": {"flops": counter.flops, "element_passes": counter.element_passes, "ops": counter.ops,
                              "flops_by_op": dict(sorted(counter.flops_by_op.items()))},
            "flops_traced": counter.flops, "wall_s": time.perf_counter() - t0}
