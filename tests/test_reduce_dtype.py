"""Every gradient collective runs in ``parallel.reduce_dtype``: the dp reduction (DDP buckets, ZeRO
reduce-scatter), the pipeline tied embedding/head sum and the sequence-parallel tp-replicated sum,
recorded by wrapping ``zerotron.distributed.comm`` (which sees every collective with its tag); a
numeric witness for the tied sum of pp2 x dp2 ZeRO-1 in bf16; and the layouts that cannot honour
the setting are refused by ``config.validate`` with one line (exit code 2 from the CLI).

One 4-process spawn."""
import pytest

from zerotron.testing import run_ranks, tiny_config

GRAD_TAGS = ("grad", "pp_tied", "tp_grad")  # parameter-gradient reductions (not norms, not activations)
BASE = {"train.steps": 2, "train.global_batch": 8, "train.eval_every": 0, "checkpoint.save_final": "false",
        "train.warmup_steps": 0}
BF16 = {"train.dtype": "bf16", "parallel.reduce_dtype": "fp32"}
LAYOUTS = {  # name: (overrides, gradient tags that must occur)
    "pp2 x dp2 ZeRO-1 bf16": ({"parallel.pp": 2, "parallel.zero_stage": 1, "train.micro_batch": 2, **BF16},
                              {"grad", "pp_tied"}),
    "pp2 x tp2 SP ZeRO-1 bf16": ({"parallel.pp": 2, "parallel.tp": 2, "parallel.sequence_parallel": "true",
                                  "parallel.zero_stage": 1, "train.micro_batch": 4, **BF16},
                                 {"grad", "pp_tied", "tp_grad"}),
    "pp2 x dp2 DDP bf16": ({"parallel.pp": 2, "train.micro_batch": 2, **BF16}, {"grad", "pp_tied"}),
    "dp2 x tp2 SP DDP bf16": ({"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.micro_batch": 2,
                               **BF16}, {"grad", "tp_grad"}),
    "dp2 x tp2 SP ZeRO-2 reduce bf16": ({"parallel.tp": 2, "parallel.sequence_parallel": "true",
                                         "parallel.zero_stage": 2, "train.micro_batch": 2,
                                         "parallel.reduce_dtype": "bf16"}, {"grad", "tp_grad"}),
}


def _worker(tmp, cache):
    from zerotron.distributed import comm

    seen = []  # (op, tag, dtype of every tensor the collective reduces)

    def wrap(op, fn, n_tensors):
        def wrapped(*args, **kw):
            if kw.get("tag", "") in GRAD_TAGS:
                seen.append((op, kw["tag"], tuple(str(t.dtype) for t in args[:n_tensors])))
            return fn(*args, **kw)
        return wrapped

    real = comm.all_reduce, comm.reduce_scatter  # put back at the end: run_ranks' ranks serve later tests
    comm.all_reduce = wrap("all_reduce", comm.all_reduce, 1)
    comm.reduce_scatter = wrap("reduce_scatter", comm.reduce_scatter, 2)  # (output, input)
    try:
        return _layouts(tmp, cache, seen)
    finally:
        comm.all_reduce, comm.reduce_scatter = real


def _layouts(tmp, cache, seen):
    import torch
    import torch.distributed as dist

    from zerotron.train.trainer import Trainer

    out = {}
    for i, (name, (lay, _)) in enumerate(LAYOUTS.items()):
        seen.clear()
        tr = Trainer(tiny_config({**BASE, **lay, "data.cache_dir": cache}), f"{tmp}/run{i}")
        witness = []
        zero = getattr(tr.strategy, "zero", None)
        tied = [f for f in zero.all_flats if f.is_tied] if zero is not None and tr.strategy.pp > 1 else []
        if tied and tr.strategy.dp_group.size() > 1 and tr.strategy.tp_group is None:
            # the tied gradient after finish_grads vs the float64 sum of every rank's local partial
            # (pp2 x dp2: each of the 4 ranks holds the first or the last stage's copy)
            (f,), finish = tied, tr.strategy.finish_grads

            def finish_and_check(f=f, finish=finish):
                partial = f.grad_full.double()
                finish()
                dist.all_reduce(partial)  # test-side reference, outside comm's accounting
                lo = f.rank * f.k
                ref = partial[lo:lo + f.k]
                witness.append(float((f.shard_grad.double() - ref).norm() / ref.norm()))
            tr.strategy.finish_grads = finish_and_check
        tr.fit()
        out[name] = {"seen": sorted(set(seen)), "witness": witness}
        assert torch.distributed.is_initialized()
    return out


@pytest.fixture(scope="module")
def runs(data_cache, tmp_path_factory):
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("rdt")), data_cache, join_timeout_s=900)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gradient_collectives_run_in_reduce_dtype(runs, name):
    lay, must = LAYOUTS[name]
    want = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}[lay["parallel.reduce_dtype"]]
    tags = set()
    for r, rank in enumerate(runs):
        for op, tag, dtypes in rank[name]["seen"]:
            assert set(dtypes) == {want}, f"{name}, rank {r}: {op} [{tag}] ran in {dtypes}, not {want}"
            tags.add(tag)
    assert tags == must, (name, tags)


def test_tied_sum_witness(runs):
    """bf16 gradients summed in fp32: the fp32 result of the two tied copies x two dp replicas is
    within fp32 rounding of the exact sum (summing in bf16 gives ~1e-3 relative)."""
    errs = [e for rank in runs for e in rank["pp2 x dp2 ZeRO-1 bf16"]["witness"]]
    assert len(errs) == 4 * BASE["train.steps"]
    assert max(errs) < 1e-6, errs


@pytest.mark.parametrize("overrides,world", [
    ({"parallel.dp_impl": "native"}, 2),
    ({"parallel.dp_impl": "torch"}, 2),
    ({"parallel.pp": 2}, 4),
    ({"parallel.tp": 2, "parallel.sequence_parallel": "true"}, 2),
])
def test_reduce_bf16_refused_without_zero(overrides, world):
    from zerotron.config import ConfigError
    from zerotron.plan import build_plan

    cfg = tiny_config({"parallel.reduce_dtype": "bf16", "train.dtype": "bf16", "train.micro_batch": 2, **overrides})
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, world)
    msg = str(e.value)
    assert "\n" not in msg and "parallel.reduce_dtype = bf16" in msg and "parallel.zero_stage" in msg, msg
    ok = tiny_config({"parallel.reduce_dtype": "bf16", "parallel.zero_stage": 1, "train.micro_batch": 2,
                      **overrides})
    assert build_plan(ok, world).dp >= 1   # ZeRO's reduce-scatter honours it
    assert build_plan(tiny_config({**overrides, "train.micro_batch": 2}), world).dp >= 1  # fp32 default


def test_reduce_bf16_refused_by_cli(capsys, tmp_path):
    from zerotron.cli import main

    code = main(["train", "--config", "configs/tiny.toml", "--parallel.reduce_dtype", "bf16", "--train.steps", "1",
                 "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "parallel.reduce_dtype = bf16" in err and len(err.strip().splitlines()) == 1, err
