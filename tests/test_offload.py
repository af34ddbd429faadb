"""Optimizer offload for native ZeRO (issue 32, ``train.offload = optimizer``): the master shards and
Adam state live in host buffers of their own and the step runs there; ``optimizer-disk`` keeps them in
memory-mapped files under ``train.offload_dir`` and steps them chunk by chunk. On this CPU-only machine host
and device are the same memory, so the same copies run between distinct buffers and the result must
equal the layout without offload bitwise (same arithmetic, same order: only where the numbers live
changes; torch's foreach AdamW on the host gives the same bits as its single-tensor loop here).
``train.offload = params`` (native ZeRO-3) also keeps the parameter shards at rest on the host and copies
each to a fresh device buffer for its all-gather: bitwise too; with FSDP2 it is torch's CPUOffloadPolicy.
``ZEROTRON_OFFLOAD_FULL=1`` adds the 4-process layouts (pp2 x dp2 ZeRO-1 and ZeRO-3, tp2 x dp2 ZeRO-3)."""
import os

import numpy as np
import pytest
import torch

from zerotron.cli import main
from zerotron.testing import run_ranks

FULL = os.environ.get("ZEROTRON_OFFLOAD_FULL", "") == "1"


def _runs(base_dir, cache, cases):
    """Each case ``(name, overrides)``: train 4 fp64 steps (checkpoint at 2) and return per case
    (losses, grad norms, breakdown of the last step, final dense parameters)."""
    from zerotron.testing import tiny_config
    from zerotron.train.trainer import Trainer

    out = {}
    for name, over in cases:
        cfg = tiny_config({"log.progress": "false", "log.plot": "false", "log.sample_tokens": "0", "train.steps": 4,
                           "train.micro_batch": 2, "data.cache_dir": cache, "checkpoint.every": 2,
                           "checkpoint.save_final": "false", "train.dtype": "fp64", "train.eval_every": 0,
                           **({"train.offload_dir": f"{base_dir}/offload"}
                              if over.get("train.offload") == "optimizer-disk" else {}),
                           **{k: v for k, v in over.items() if k != "resume"}})
        run_dir = f"{base_dir}/{name}"
        if "resume" in over:  # resume the checkpoint of another case's run at step 2
            import shutil
            from pathlib import Path
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            if torch.distributed.get_rank() == 0:
                shutil.copytree(f"{base_dir}/{over['resume']}/checkpoints", f"{run_dir}/checkpoints")
                for f in ("checkpoints/step_4",):
                    shutil.rmtree(f"{run_dir}/{f}", ignore_errors=True)
            torch.distributed.barrier()
        recs, timing = [], []
        tr = Trainer(cfg, run_dir, resume="resume" in over)
        tr.fit(callback=lambda t, r: (recs.append((r["loss"], r["grad_norm"], r["model_state_breakdown"])),
                                      timing.append({k: v for k, v in r.items() if k.startswith("offload_")})))
        # canonical, dense; numpy arrays travel back by value (no shared-memory file descriptors to a
        # rank that may be gone by the time the parent unpickles them)
        params = {k: v.detach().cpu().clone().numpy() for k, v in tr.strategy.state_dict()[0].items()}
        out[name] = ([r[:2] for r in recs], recs[-1][2], params, timing)
    return out


def _check_timing(res, name, disk: bool) -> None:
    """metrics.jsonl's offload timing: every step copied (gradients out; parameters back, counted in
    the next step, which waits for them) and says how long it waited (``offload_hidden`` <= 1; below
    0 when the waits also covered copies queued behind others); the disk tier (no gradient copy on a
    CPU-only machine: its first step copies nothing yet) also counts its I/O threads' seconds."""
    for i, t in enumerate(res[name][3]):
        if disk and i == 0:
            assert t["offload_copy_s"] == 0 and t["offload_hidden"] is None, (name, t)
        else:
            assert t["offload_copy_s"] > 0 and t["offload_wait_s"] >= 0 and t["offload_hidden"] <= 1, (name, t)
        assert ("offload_io_s" in t) == disk, (name, t)
        if disk:
            assert t["offload_io_s"] > 0 and t["offload_io_wait_s"] >= 0, (name, t)


def _check(res, a, b):
    (la, _, pa, _), (lb, _, pb, _) = res[a], res[b]
    assert la == lb, (a, b, la, lb)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]), (a, b, k)


def test_offload_equals_no_offload_dp2(tmp_path, data_cache):
    """dp 2, ZeRO-1/2/3 with and without offload: losses, grad norms and final parameters bitwise;
    the device's optimizer_bytes is 0 and host_bytes holds masters + Adam state + host gradient
    (4 shard-sized fp64 buffers); resuming a run without offload with offload (and back) equals the
    uninterrupted run bitwise."""
    cases = []
    for z in (1, 2, 3):
        cases += [(f"z{z}", {"parallel.zero_stage": z}), (f"z{z}-off", {"parallel.zero_stage": z, "train.offload": "optimizer"}),
                  (f"z{z}-disk", {"parallel.zero_stage": z, "train.offload": "optimizer-disk"})]
    z3p = {"parallel.zero_stage": 3, "train.offload": "params"}
    f3 = {"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}
    cases += [("z3-params", z3p), ("z3-resume-params", {**z3p, "resume": "z3-off"}),
              ("z3-resume-none-from-params", {"parallel.zero_stage": 3, "resume": "z3-params"}),
              ("f3", f3), ("f3-params", {**f3, "train.offload": "params"})]
    cases += [("z1-resume-off", {"parallel.zero_stage": 1, "train.offload": "optimizer", "resume": "z1"}),
              ("z3-resume-none", {"parallel.zero_stage": 3, "resume": "z3-off"}),
              ("z2-resume-disk", {"parallel.zero_stage": 2, "train.offload": "optimizer-disk", "resume": "z2-off"}),
              ("z1-resume-none-from-disk", {"parallel.zero_stage": 1, "resume": "z1-disk"})]
    res = run_ranks(_runs, 2, str(tmp_path), data_cache, cases)[0]
    for z in (1, 2, 3):
        _check(res, f"z{z}", f"z{z}-off")
        _check(res, f"z{z}", f"z{z}-disk")
        _check_timing(res, f"z{z}-off", disk=False)
        _check_timing(res, f"z{z}-disk", disk=True)
        assert res[f"z{z}"][3] == [{}] * 4  # no offload: no timing fields
        off, ref, disk = res[f"z{z}-off"][1], res[f"z{z}"][1], res[f"z{z}-disk"][1]
        assert off["optimizer_bytes"] == 0 and ref["optimizer_bytes"] > 0 and "host_bytes" not in ref
        shard_bytes = ref["optimizer_bytes"] // 2  # fp64: exp_avg + exp_avg_sq (master aliased/param at stage 3)
        assert off["host_bytes"] == 4 * shard_bytes and off["disk_bytes"] == 0
        assert off["params_bytes"] == ref["params_bytes"] and off["grads_bytes"] == ref["grads_bytes"]
        # the disk tier: master + Adam state in the files, no host gradient on a CPU-only machine
        assert disk["optimizer_bytes"] == 0 and disk["host_bytes"] == 0 and disk["disk_bytes"] == 3 * shard_bytes
        assert disk["params_bytes"] == ref["params_bytes"] and disk["grads_bytes"] == ref["grads_bytes"]
    # parameter offload: bitwise; nothing of the parameters on the device at rest, the host holds the
    # compute shard (the fp64 master itself) + Adam state + host gradient
    _check(res, "z3", "z3-params")
    par, ref = res["z3-params"][1], res["z3"][1]
    assert par["params_bytes"] == 0 and ref["params_bytes"] > 0 and par["optimizer_bytes"] == 0
    assert par["host_params_bytes"] == ref["params_bytes"] and par["host_bytes"] == 2 * ref["params_bytes"] + \
        ref["optimizer_bytes"] and par["host_optimizer_bytes"] == ref["optimizer_bytes"]
    assert par["grads_bytes"] == ref["grads_bytes"] and par["disk_bytes"] == 0
    _check(res, "f3", "f3-params")  # FSDP2 with torch's CPUOffloadPolicy
    for rank in (0, 1):  # the state files are unlinked once mapped and the rank folders removed: nothing is left
        assert not (tmp_path / "offload" / f"rank-{rank}").exists()
    for resumed, ref in (("z1-resume-off", "z1"), ("z3-resume-none", "z3"), ("z2-resume-disk", "z2"),
                         ("z1-resume-none-from-disk", "z1"), ("z3-resume-params", "z3"),
                         ("z3-resume-none-from-params", "z3")):
        assert res[resumed][0] == res[ref][0][2:]  # steps 3-4
        for k, v in res[ref][2].items():
            assert np.array_equal(v, res[resumed][2][k]), (resumed, k)


@pytest.mark.skipif(not FULL, reason="4-process layouts: set ZEROTRON_OFFLOAD_FULL=1")
def test_offload_equals_no_offload_4ranks(tmp_path, data_cache):
    """pp 2 x dp 2 ZeRO-1 and tp 2 x dp 2 ZeRO-3, with and without offload: bitwise; parameter offload
    with tp 2 x dp 2 ZeRO-3 and pp 2 x dp 2 ZeRO-3 (1F1B)."""
    cases = []
    for name, over in (("pp2z1", {"parallel.pp": 2, "parallel.zero_stage": 1}),
                       ("tp2z3", {"parallel.tp": 2, "parallel.zero_stage": 3})):
        cases += [(name, over), (name + "-off", {**over, "train.offload": "optimizer"}),
                  (name + "-disk", {**over, "train.offload": "optimizer-disk"})]
    pp2z3 = {"parallel.pp": 2, "parallel.zero_stage": 3}
    cases += [("tp2z3-params", {"parallel.tp": 2, "parallel.zero_stage": 3, "train.offload": "params"}),
              ("pp2z3", pp2z3), ("pp2z3-params", {**pp2z3, "train.offload": "params"})]
    res = run_ranks(_runs, 4, str(tmp_path), data_cache, cases)
    for r in res:
        for name in ("pp2z1", "tp2z3"):
            _check(r, name, name + "-off")
            _check(r, name, name + "-disk")
        _check(r, "tp2z3", "tp2z3-params")
        _check(r, "pp2z3", "pp2z3-params")


def test_offload_single_process(tmp_path, data_cache, single_process):
    """One process, ZeRO-1 and ZeRO-3 (parameter offload) over dp 1: the same bitwise equality."""
    res = _runs(str(tmp_path), data_cache, [("z1", {"parallel.zero_stage": 1}),
                                            ("z1-off", {"parallel.zero_stage": 1, "train.offload": "optimizer"}),
                                            ("z1-disk", {"parallel.zero_stage": 1, "train.offload": "optimizer-disk"}),
                                            ("z3", {"parallel.zero_stage": 3}),
                                            ("z3-params", {"parallel.zero_stage": 3, "train.offload": "params"})])
    _check(res, "z1", "z1-off")
    _check(res, "z1", "z1-disk")
    _check(res, "z3", "z3-params")


@pytest.mark.parametrize("argv,message", [
    ([], "train.offload = optimizer needs native ZeRO"),
    (["--parallel.dp_impl", "torch"], "needs native ZeRO (parallel.zero_stage 1, 2 or 3 with parallel.zero_impl "
                                      "= native): torch DDP keeps"),
    (["--parallel.zero_stage", "3", "--parallel.zero_impl", "fsdp2"], "FSDP2 keeps the optimizer state"),
    (["--parallel.zero_stage", "1", "--train.offload", "gpu"], "train.offload must be none, optimizer, optimizer-disk or params"),
    (["--parallel.zero_stage", "2", "--train.offload", "params"], "train.offload = params needs parameters sharded at rest"),
    (["--train.offload", "params"], "DDP keeps the full parameters on every rank"),
    (["--parallel.zero_stage", "1", "--train.offload_dir", "/tmp"], "train.offload_dir is used by train.offload = "
                                                                     "optimizer-disk only"),
    (["--parallel.zero_stage", "1", "--train.offload", "optimizer-disk"], "needs train.offload_dir"),
])
def test_offload_refused(argv, message, capsys, tmp_path):
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--nproc", "2",
                 "--train.offload", "optimizer", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_offload_estimator():
    """``model_state_bytes(offload="optimizer")``: the optimizer's share moves to the host, 16 bytes per
    shard element for Adam (fp32 master + m + v + host gradient); the 7B / N = 8 table; stage 0 refused."""
    from zerotron.analysis.memory import model_state_bytes, zero_table

    rows = zero_table(7 * 10**9, 8, "fp32", "adam", offload="optimizer")
    assert [(r["stage"], r["total_bytes"], r["host_bytes"], r["optimizer_bytes"]) for r in rows] == [
        (1, 56 * 10**9, 14 * 10**9, 0), (2, 31.5 * 10**9, 14 * 10**9, 0), (3, 7 * 10**9, 14 * 10**9, 0)]
    mixed = model_state_bytes(8000, 8, 1, "bf16-mixed", offload="optimizer")
    assert mixed["host_bytes"] == 1000 * 16 and mixed["total_bytes"] == 8000 * 4
    assert model_state_bytes(8000, 8, 1, "fp64", offload="optimizer")["host_bytes"] == 1000 * 32
    with pytest.raises(ValueError, match="offload"):
        model_state_bytes(8000, 8, 0, offload="optimizer")
    # the disk tier: master + Adam state (12 bytes per shard element) on disk, the host gradient (4) in memory
    rows = zero_table(7 * 10**9, 8, "fp32", "adam", offload="optimizer-disk")
    assert [(r["stage"], r["total_bytes"], r["host_bytes"], r["disk_bytes"]) for r in rows] == [
        (1, 56 * 10**9, 3.5 * 10**9, 10.5 * 10**9), (2, 31.5 * 10**9, 3.5 * 10**9, 10.5 * 10**9),
        (3, 7 * 10**9, 3.5 * 10**9, 10.5 * 10**9)]
    mixed = model_state_bytes(8000, 8, 1, "bf16-mixed", offload="optimizer-disk")
    assert mixed["host_bytes"] == 1000 * 4 and mixed["disk_bytes"] == 1000 * 12
    # parameter offload (stage 3 only): no parameter bytes on the device, the bf16 shard (2) joins the host's 16
    rows = zero_table(7 * 10**9, 8, "bf16-mixed", "adam", offload="params")
    assert [(r["stage"], r["params_bytes"], r["total_bytes"], r["host_bytes"]) for r in rows] == [
        (3, 0, 1.75 * 10**9, 15.75 * 10**9)]
    assert model_state_bytes(8000, 8, 3, "fp32", offload="params")["host_bytes"] == 1000 * 16  # master = compute shard
    with pytest.raises(ValueError, match="params only with stage 3"):
        model_state_bytes(8000, 8, 2, offload="params")


def _disk_argv(tmp_path, offload_dir):
    return ["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "r"), "--nproc", "2",
            "--parallel.zero_stage", "1", "--train.offload", "optimizer-disk", "--train.offload_dir", str(offload_dir)]


def test_offload_dir_refused(capsys, tmp_path, monkeypatch):
    """The disk tier's folder, checked before any process starts: missing, read-only (no write bit;
    refused even for root), too small for the files (free space faked) -- one line each, exit 2,
    nothing written (no run directory, the folder left empty)."""
    import shutil

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    small = tmp_path / "small"
    small.mkdir()
    real = shutil.disk_usage
    for folder, message, fake_free in ((tmp_path / "missing", "does not exist", None), (ro, "is read-only", None),
                                       (small, "bytes free, the optimizer state files need about", 1000)):
        if fake_free is not None:
            monkeypatch.setattr(shutil, "disk_usage", lambda p, r=real: r(p)._replace(free=fake_free))
        code = main(_disk_argv(tmp_path, folder))
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "r").exists() and (not folder.exists() or not any(folder.iterdir()))
    ro.chmod(0o755)


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_overlap_order(tmp_path, data_cache, single_process, monkeypatch, stage):
    """Where the copies happen (one process, 4 blocks, fp64, 2 steps): each gradient shard leaves for
    the host as soon as its unit's reduce-scatter is finished, while later units are still being
    reduced (so during backward: the reductions are launched from gradient hooks), not after the
    last one; the updated shards go back after the step and are waited for unit by unit in the
    next forward (ZeRO-1: each block's forward pre-hook all-gathers its own, the next one's
    prefetched; ZeRO-3: right before each unit's all-gather), not all before it starts."""
    from zerotron.parallel.data import flat_shard, host_copies
    from zerotron.testing import tiny_config
    from zerotron.train.trainer import Trainer

    log = []
    launch, copy, settle = (flat_shard.FlatShard.launch_reduce, host_copies.HostCopies.copy,
                            flat_shard.FlatShard.settle_arrival)

    def logged_launch(f):
        log.append(("reduce", f.names[0]))
        return launch(f)

    def logged_copy(c, dst, src):
        log.append(("grad_out", None))
        return copy(c, dst, src)

    def logged_settle(f):
        if f.arrival is not None:
            log.append(("param_in", f.names[0]))
        return settle(f)
    monkeypatch.setattr(flat_shard.FlatShard, "launch_reduce", logged_launch)
    monkeypatch.setattr(host_copies.HostCopies, "copy", logged_copy)
    monkeypatch.setattr(flat_shard.FlatShard, "settle_arrival", logged_settle)
    cfg = tiny_config({"train.steps": 2, "train.micro_batch": 2, "data.cache_dir": data_cache, "train.dtype": "fp64",
                       "train.eval_every": 0, "checkpoint.save_final": "false", "parallel.zero_stage": stage,
                       "train.offload": "optimizer"})
    tr = Trainer(cfg, str(tmp_path / "run"))

    def blocks_run(module, args):
        log.append(("block", None))
    for b in tr.strategy.module.blocks():
        b.register_forward_pre_hook(blocks_run)
    tr.fit(callback=lambda t, r: log.append(("step", None)))
    kinds = [k for k, _ in log]
    first = kinds.index("step")
    step1 = kinds[:first]
    # gradients: the first copy comes before the step's last reduce-scatter is launched
    reduces = [i for i, k in enumerate(step1) if k == "reduce"]
    outs = [i for i, k in enumerate(step1) if k == "grad_out"]
    assert len(outs) == len(tr.strategy.grad_flats) and outs[0] < reduces[-1], step1
    # parameters: the second step's forward interleaves the blocks with the arrivals of their shards
    step2 = kinds[first + 1:]
    ins = [i for i, k in enumerate(step2) if k == "param_in"]
    blocks = [i for i, k in enumerate(step2) if k == "block"]
    assert len(ins) == len(tr.strategy.grad_flats) and ins[0] < blocks[0] < ins[-1], step2


def test_offload_dir_filled_after_the_check(tmp_path, data_cache):
    """The disk tier's folder fills after the launcher's check (another writer; here the check is
    stubbed as passed on a real 256 KiB tmpfs in a user + mount namespace, the tiny model's state
    needing ~2.8 MB): the state files' blocks are reserved when they are made (posix_fallocate), so
    the run stops with one line naming train.offload_dir, the error and the bytes free, exit 2, and
    leaves nothing in the folder. Before, the first store into a sparse file's hole through the
    mapping killed the process with SIGBUS and not a word (a pwrite into one: ENOSPC mid-step)."""
    import shlex
    import shutil
    import subprocess
    import sys

    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) to mount a tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = ["train", "--config", "configs/tiny.toml", "--run-dir", str(tmp_path / "run"), "--train.steps", "1",
            "--parallel.zero_stage", "1", "--train.offload", "optimizer-disk", "--train.offload_dir", str(disk),
            "--data.cache_dir", data_cache, "--log.sample_tokens", "0", "--log.plot", "false", "--log.progress", "false"]
    code = ("import sys, zerotron.analysis.memory as m; m.offload_dir_refusal = lambda *a, **k: None; "
            f"from zerotron.cli import main; sys.exit(main({argv!r}))")
    script = (f"mount -t tmpfs -o size=256k tmpfs {shlex.quote(str(disk))} || exit 77; "
              f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}; rc=$?; ls -A {shlex.quote(str(disk))}; exit $rc")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root})
    if r.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[-200:]}")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert f"train.offload_dir {str(disk)!r}: cannot create the optimizer state files in " in lines[0], lines
    assert "(No space left on device; " in lines[0] and "bytes free): free space there or choose" in lines[0], lines
    assert r.stdout.strip() == "", r.stdout  # nothing left in the folder (no rank-0 subfolder, no file)


def test_disk_state_never_takes_an_existing_file(tmp_path):
    """A state file is created, never opened: an existing file at the path (another run's, mapped
    and not yet unlinked, or the user's own) is refused with FileExistsError and left as it was. With
    O_TRUNC two runs sharing train.offload_dir could truncate and map one inode between open and
    unlink; their file names also differ now (the process id)."""
    from zerotron.parallel.data.disk_state import DiskState

    f = tmp_path / "flat-0.bin"
    f.write_bytes(b"someone else's state")
    with pytest.raises(FileExistsError):
        DiskState(str(f), 1000, torch.float32)
    assert f.read_bytes() == b"someone else's state"
    d = DiskState(str(tmp_path / "new.bin"), 1000, torch.float32)
    assert os.listdir(tmp_path) == ["flat-0.bin"] and os.fstat(d.fd).st_blocks * 512 >= d.nbytes  # reserved


def test_disk_state_release():
    """``DiskState``: values written through the mapping survive ``release`` (MADV_DONTNEED on a
    shared file mapping), which takes the pages out of the process's resident set. ``disk_step``
    (reader and writer threads, ``depth`` staging buffers) gives the same bits as one torch AdamW
    step over each whole vector, for two buffers in one call, ragged tails, one buffer in flight or
    two, and leaves the mapped vectors as the state."""
    import tempfile

    from zerotron.parallel.data.disk_state import DiskState, disk_step

    def rss_file_kb():
        with open("/proc/self/status") as f:
            return sum(int(ln.split()[1]) for ln in f if ln.startswith(("RssFile:", "RssShmem:")))

    chunk = 1 << 16
    sizes = (3 * chunk + 17, chunk - 5)
    with tempfile.TemporaryDirectory() as d:
        disks = [DiskState(f"{d}/x{i}.bin", n, torch.float64) for i, n in enumerate(sizes)]
        assert os.listdir(d) == []  # unlinked once mapped
        vals = [torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                for i, n in enumerate(sizes)]
        torch.empty_like(vals[0]).copy_(vals[0])  # the copy kernel's code pages count as RssFile: fault them in first
        before = rss_file_kb()
        disks[0].tensors["master"].copy_(vals[0])
        grown = rss_file_kb() - before
        disks[0].release()
        assert grown > 0.9 * sizes[0] * 8 / 1024 and rss_file_kb() - before < 0.1 * grown, (grown, rss_file_kb() - before)
        assert torch.equal(disks[0].tensors["master"], vals[0])
        disks[1].tensors["master"].copy_(vals[1])

        refs = [torch.nn.Parameter(v.clone()) for v in vals]
        ref_opt = torch.optim.AdamW(refs, lr=0.1, weight_decay=0.1)
        ps = [torch.nn.Parameter(dk.tensors["master"]) for dk in disks]
        opt = torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=True)
        for p, dk in zip(ps, disks):
            opt.state[p].update(step=torch.tensor(0.0), exp_avg=dk.tensors["exp_avg"], exp_avg_sq=dk.tensors["exp_avg_sq"])
        for i, depth in enumerate((2, 1, 3)):
            gs = [torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * i + j + 1))
                  for j, n in enumerate(sizes)]
            for r, g in zip(refs, gs):
                r.grad = g.clone()
            ref_opt.step()
            t = disk_step(opt, [(p, g, dk) for p, g, dk in zip(ps, gs, disks)], chunk=chunk, depth=depth)
            assert t["io_s"] > 0 and t["io_wait_s"] >= 0
        for p, r, dk in zip(ps, refs, disks):
            assert torch.equal(p.detach(), r.detach()) and p.grad is None
            assert p.data_ptr() == dk.tensors["master"].data_ptr()
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], ref_opt.state[r][k]), k
            assert opt.state[p]["exp_avg"].data_ptr() == dk.tensors["exp_avg"].data_ptr()


def test_plan_prices_host_link():
    """``zerotron plan --host-link``: a layout that does not fit is priced again with offload; its
    device memory is the estimator's with offload, and the host link's seconds are its bytes
    (6 per shard element for optimizer offload, 4 + 4m for params) over the link's bandwidth."""
    from zerotron.analysis.cost_model import CostModel, host_bytes
    from zerotron.analysis.hardware import HOST_LINKS, hardware
    from zerotron.analysis.layout_cost import evaluate
    from zerotron.analysis.planner import plan
    from zerotron.models.registry import preset_config

    cfg = preset_config("llama3-8b")
    cm = CostModel(hardware("h100"), host_link=HOST_LINKS["pcie4"])
    plain = plan(cfg, 8, 24 * 10**9, 64, 2048, CostModel(hardware("h100")))
    offl = plan(cfg, 8, 24 * 10**9, 64, 2048, cm)
    assert not any("offload" in r for r in plain["layouts"])
    assert len(offl["layouts"]) > len(plain["layouts"]) and any(r.get("offload") for r in offl["layouts"])
    assert all(r["memory_bytes_per_gpu"] <= 24 * 10**9 for r in offl["layouts"])
    lay = {"dp": 8, "tp": 1, "pp": 1, "zero_stage": 3, "schedule": "none", "micro_batch": 1, "recompute": "full"}
    base, par = evaluate(cfg, lay, 2048, 64, cm), evaluate(cfg, {**lay, "offload": "params"}, 2048, 64, cm)
    shard = -(-cfg_params(cfg) // 8)
    assert par["host_bytes_per_step"] == host_bytes("params", shard, 8) == (4 + 32) * shard
    assert abs(par["time_breakdown_s"]["host_comm"] - par["host_bytes_per_step"] / 31.5e9) < 1e-12
    assert base["memory_bytes_per_gpu"] - par["memory_bytes_per_gpu"] == 2 * shard + 12 * shard  # bf16 shard, K=12
    code = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--seq", "2048",
                 "--gpu-mem", "24GB", "--host-link", "pcie5", "--top", "1"])
    assert code == 0


def cfg_params(cfg) -> int:
    from zerotron.analysis.memory import stage_num_params

    return max(stage_num_params(cfg, 1, 1))
