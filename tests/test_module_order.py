"""Models whose forward does not run every block in registration order: ZeRO-3 prefetch safety
(a prefetched block that is skipped, blocks run out of order) and parameters that get no gradient,
each at dp 2 against the same model trained by one process.

The model is a GPT whose forward follows a per-step *plan*: ``plan[step]`` lists ``(block, mlp)``
pairs run in that order (``mlp`` False: the block's MLP is skipped, so half of its parameters get no
gradient). Data is random tokens from a per-step seed; every layout sees the same global batch."""
import numpy as np
import pytest
import torch

from zerotron.models.gpt import GPT, Block, GPTConfig
from zerotron.plan import ParallelPlan
from zerotron.testing import assert_params_close, run_ranks, tiny_config

SHAPE = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
GLOBAL = 8
MICRO = 2  # MicroPlanGPT: samples per plan entry (= train.micro_batch of its runs)


class _PlanBlock(Block):
    skip_mlp = False

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln_1(x), kv_cache)
        return x if self.skip_mlp else x + self.mlp(self.ln_2(x))


class PlanGPT(GPT):
    """GPT running ``plan[self.step]`` (a list of ``(block index, run its MLP)``) in its forward."""

    def __init__(self, cfg, plan):
        super().__init__(cfg)
        self.plan, self.step = plan, 0
        for b in self.transformer.h:
            b.__class__ = _PlanBlock

    def forward(self, idx, kv_cache=None):
        x = self.embed(idx)
        for i, mlp in self.plan[self.step]:
            blk = self.transformer.h[i]
            blk.skip_mlp = not mlp
            x = blk(x)
        return self.head(x)


class MicroPlanGPT(PlanGPT):
    """``plan[step][g]``: the ``(block, mlp)`` pairs run on global micro-batch ``g`` of the step (of
    ``MICRO`` samples each; this rank's first is ``offset``), so a parameter can get its gradient in
    some micro-batches of an accumulation window only. Forwards without grad (eval) run
    ``plan[step][0]``. The same samples meet the same blocks on every layout."""

    offset = 0

    def forward(self, idx, kv_cache=None):
        if not torch.is_grad_enabled():
            pairs = self.plan[self.step][0]
        else:
            if getattr(self, "_at", None) != self.step:
                self._at, self._count = self.step, 0
            assert idx.size(0) == MICRO, "MicroPlanGPT: one micro-batch per plan entry"
            pairs = self.plan[self.step][self.offset + self._count]
            self._count += 1
        x = self.embed(idx)
        for i, mlp in pairs:
            blk = self.transformer.h[i]
            blk.skip_mlp = not mlp
            x = blk(x)
        return self.head(x)


def _batch(step, rank, dp, micro):
    tok = torch.randint(0, SHAPE["vocab_size"], (GLOBAL, SHAPE["block_size"] + 1),
                        generator=torch.Generator().manual_seed(100 + step))
    x, y = tok[:, :-1], tok[:, 1:]
    n = GLOBAL // dp
    x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    return [(x[i:i + micro], y[i:i + micro]) for i in range(0, n, micro)]


def _zero3_invariants(strategy) -> list:
    """Problems with the ZeRO-3 storage between steps: a pending all-gather, or a block buffer
    still holding storage."""
    bad = []
    for u, fl in enumerate(strategy.flats):
        for f in fl:
            if f.gather_work is not None:
                bad.append(f"unit {u}: all-gather still pending")
            if f.full.untyped_storage().size() != 0:
                bad.append(f"unit {u}: storage not released")
    return bad


def _train(lay: dict, plan: list, overrides: dict, cls=PlanGPT) -> dict:
    """Train ``PlanGPT`` for ``len(plan)`` steps on this rank (``lay``: config overrides; empty
    with world size 1 = the plain single-process reference). Returns losses, grad norms, the
    canonical parameters and optimizer state, and invariant violations."""
    import torch.distributed as dist

    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.parallel import parallelize
    from zerotron.parallel.base import Strategy
    from zerotron.train.optim import build_scheduler, decay_mask
    from zerotron.train.step import evaluate, train_step

    world = dist.get_world_size()
    cfg = tiny_config({"train.steps": len(plan), "train.global_batch": GLOBAL, "train.dtype": "fp64",
                       **overrides, **lay})
    mesh = Mesh(ParallelDims(world), torch.device("cpu"))
    torch.manual_seed(0)
    model = cls(GPTConfig(**SHAPE), plan).double()  # fp64: parity at RTOL on any CPU
    out = {"losses": [], "norms": [], "bad": [], "snaps": [],
           "init": {n: p.detach().clone().numpy() for n, p in model.named_parameters()}}
    if world == 1:
        strategy, mask = Strategy(model), decay_mask(model)
    else:
        strategy = parallelize(model, ParallelPlan.from_config(cfg, mesh.dims), mesh)
        mask = strategy.decay_mask
    opt = strategy.build_optimizer(cfg.train, mask)
    sched = build_scheduler(opt, cfg.train)
    dp, rank = mesh.size("dp"), mesh.local_rank("dp")
    model.offset = rank * (GLOBAL // dp // cfg.train.micro_batch)  # MicroPlanGPT: this rank's first micro-batch
    zero3 = cfg.parallel.zero_stage == 3 and cfg.parallel.zero_impl == "native"
    for step in range(len(plan)):
        model.step = step
        try:
            rec = train_step(strategy, opt, sched, _batch(step, rank, dp, cfg.train.micro_batch), mesh.group("dp"),
                             cfg.train.grad_clip)
        except ValueError as e:  # ConfigError: a refused layout; the parameters as the error left them
            return {"error": str(e), "step": step, "opt_state": len(opt.state),
                    "at_error": {n: p.detach().clone().numpy() for n, p in model.named_parameters()}}
        out["snaps"].append(_canonical(strategy, opt))
        out["losses"].append(rec["loss"])
        out["norms"].append(rec["grad_norm"])
        if zero3:
            out["bad"] += [f"step {step}: {b}" for b in _zero3_invariants(strategy)]
        if step == 0:  # a gradient-free forward (the eval path) between steps
            out["val"] = evaluate(strategy, _batch(99, rank, dp, GLOBAL // dp), "fp32")
            if zero3:
                out["bad"] += [f"after eval: {b}" for b in _zero3_invariants(strategy)]
    with strategy.full_params() as m:  # every parameter readable, equal to the canonical state
        out["full"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().numpy()
                       for n, p in m.named_parameters()}
    out["params"], out["state"] = out["snaps"][-1]
    if zero3:  # the guard: resizing a buffer an all-gather is still writing raises
        f = strategy.flats[1][0]
        f.launch_gather()
        try:
            f._set_storage(0)
            out["bad"].append("guard did not raise")
        except RuntimeError as e:
            out["guard"] = str(e)
        f.free()
        out["bad"] += [f"after guard: {b}" for b in _zero3_invariants(strategy)]
    return out


def _canonical(strategy, opt):
    """(params, optimizer state) in the canonical FQN-keyed format, as numpy / floats."""
    msd, osd = strategy.state_dict(opt)
    params = {k: v.detach().double().numpy().copy() for k, v in msd.items()}
    state = {k: {n: (v.detach().double().numpy().copy() if v.dim() else float(v)) for n, v in st.items()}
             for k, st in osd["state"].items()}
    return params, state


def _many(layouts, plan, overrides):
    return [_train(lay, plan, overrides) for lay in layouts]


RTOL = 1e-10  # fp64: reassociation noise only; a wrongly updated parameter is off by ~lr / |w| ~ 0.1


def _compare(ref, out, what, rtol=RTOL):
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=rtol, err_msg=what)
    np.testing.assert_allclose(out["norms"], ref["norms"], rtol=rtol, err_msg=what)
    np.testing.assert_allclose(out["val"], ref["val"], rtol=rtol, err_msg=what)
    assert_params_close(out["params"], ref["params"], rtol, what)  # (leaves out the zero-gradient key bias)
    assert_params_close(out["full"], ref["params"], rtol, f"{what} full_params", subset=True)


# ---- ZeRO-3 prefetch: skipped and reordered blocks ----------------------------------------------

# block 3 never runs (block 2 prefetches it every step); the others run out of registration order,
# so both forward (i + 1) and backward (i - 1) prefetches hit blocks that are not next. Weight decay
# is off: a block that never runs then stays exactly at its initial value under every optimizer.
ORDER_PLAN = [[(0, True), (2, True), (1, True)], [(2, True), (1, True), (0, True)],
              [(1, True), (0, True), (2, True)]]
ORDER = {"train.weight_decay": 0.0, "train.micro_batch": 2, "train.grad_clip": 1.0}


def test_zero3_prefetch_any_module_order(single_process):
    ref = _train({}, ORDER_PLAN, ORDER)
    layouts = [{"parallel.zero_stage": 3}, {"parallel.zero_stage": 3, "train.micro_batch": 4},
               {"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}]
    runs = run_ranks(_many, 2, layouts, ORDER_PLAN, ORDER, join_timeout_s=120)  # before the fix: hung or crashed
    for lay, out in zip(layouts, runs[0]):
        assert out["bad"] == [], (lay, out["bad"])
        _compare(ref, out, str(lay))
    assert "pending" in runs[0][0]["guard"] and "pending" in runs[1][1]["guard"]
    untouched = [k for k in ref["init"] if k.startswith("transformer.h.3.")]
    assert untouched
    for k in untouched:  # the never-run block keeps its initial value everywhere
        for out in [ref] + runs[0]:
            np.testing.assert_array_equal(out["params"][k], ref["init"][k], err_msg=k)


# ---- parameters without gradient ------------------------------------------------------------------

# step 0: block 1 skipped, block 2 without its MLP (its flat buffers are used in part); step 1: all
# three run (block 1 and block 2's MLP for the first time: their AdamW step counts now differ from
# their neighbours'); step 2: block 1 without its MLP (which has Adam state: it must stay frozen).
# Block 3 never runs. Weight decay and clipping are on, so any update of an unused parameter shows.
UNUSED_PLAN = [[(0, True), (2, False)], [(2, True), (0, True), (1, True)], [(0, True), (1, False), (2, True)]]
UNUSED = {"train.weight_decay": 0.1, "train.grad_clip": 1.0, "train.micro_batch": 2}
FROZEN = "transformer.h.1.mlp."  # unused in step 2 only


def test_unused_parameters_skipped_like_one_process(single_process):
    ref = _train({}, UNUSED_PLAN, UNUSED)
    layouts = [{"train.micro_batch": 4}, {"parallel.bucket_mb": 0.01},           # native DDP, many buckets
               {"parallel.dp_impl": "torch", "parallel.find_unused_parameters": True},
               {"parallel.zero_stage": 1}, {"parallel.zero_stage": 2, "train.micro_batch": 4},
               {"parallel.zero_stage": 3}, {"parallel.zero_stage": 1, "train.micro_batch": 4},
               {"parallel.dp_impl": "torch"}]                                   # refused: last (desynced DDP)
    runs = run_ranks(_many, 2, layouts, UNUSED_PLAN, UNUSED, join_timeout_s=300)
    for r in (0, 1):
        err = runs[r][-1].get("error", "")
        assert "transformer.h.1" in err and "parallel.find_unused_parameters = true" in err and "\n" not in err, err
    never = [k for k in ref["init"] if k.startswith("transformer.h.3.")]
    frozen = [k for k in ref["init"] if k.startswith(FROZEN)]
    assert never and frozen
    for k in never:  # the one-process semantics being matched: never stepped, no state
        np.testing.assert_array_equal(ref["params"][k], ref["init"][k])
        assert k not in ref["state"]
    for k in frozen:
        np.testing.assert_array_equal(ref["snaps"][2][0][k], ref["snaps"][1][0][k])
    for lay, out in zip(layouts[:-1], runs[0][:-1]):
        what = str(lay)
        assert "error" not in out, (what, out.get("error"))
        _compare(ref, out, what)
        assert set(out["state"]) == set(ref["state"]), (what, sorted(set(out["state"]) ^ set(ref["state"])))
        for key in ("exp_avg", "exp_avg_sq"):
            assert_params_close({k: v[key] for k, v in out["state"].items()},
                                {k: v[key] for k, v in ref["state"].items()}, RTOL, f"{what} {key}", subset=True)
        assert {k: v["step"] for k, v in out["state"].items()} == {k: v["step"] for k, v in ref["state"].items()}, what
        for k in never:
            np.testing.assert_array_equal(out["params"][k], ref["init"][k], err_msg=f"{what} {k}")
        (p1, s1), (p2, s2) = out["snaps"][1], out["snaps"][2]
        for k in frozen:  # untouched in step 2: value, moments, step -- bit for bit
            np.testing.assert_array_equal(p2[k], p1[k], err_msg=f"{what} {k}")
            assert s2[k]["step"] == s1[k]["step"] == 1.0, (what, k)
            for key in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(s2[k][key], s1[k][key], err_msg=f"{what} {k} {key}")


# ---- a gradient in some micro-batches of the accumulation window only (issue 27) --------------------

# MicroPlanGPT plans: one entry per global micro-batch of MICRO samples; at dp 2 rank 0 runs entries
# 0, 1 and rank 1 entries 2, 3, each in that order (entry 1 / 3: the last, synchronised backward).
ALL = [(0, True), (1, True), (2, True), (3, True)]
NO1 = [(0, True), (2, True), (3, True)]  # block 1 skipped
EARLY_PLAN = [[ALL, NO1, ALL, NO1],  # step 1: block 1 only in the first (no_sync) micro-batch of each rank
              [NO1, ALL, NO1, ALL],  # step 2: only in the last
              [NO1, NO1, NO1, NO1]]  # step 3: nowhere (grad None: frozen, as on one process)
LAST_PLAN = [[NO1, ALL, NO1, ALL], [ALL, ALL, ALL, ALL]]  # every parameter in every last micro-batch
CROSS_PLAN = [[ALL, ALL, ALL, NO1]]  # block 1 in rank 0's last micro-batch, not in rank 1's
MICRO_RUN = {"train.weight_decay": 0.1, "train.grad_clip": 1.0, "train.micro_batch": MICRO}
TORCH, FIND = {"parallel.dp_impl": "torch"}, {"parallel.dp_impl": "torch", "parallel.find_unused_parameters": True}


def _micro_cases(cases):
    return [_train(lay, plan, MICRO_RUN, MicroPlanGPT) for lay, plan in cases]


def test_torch_ddp_gradient_only_in_earlier_micro_batch(single_process):
    """torch DDP reduces a bucket only in the window's last backward: a parameter whose gradient came
    from an earlier (no_sync) micro-batch only is refused at step 1 with the one-line ConfigError,
    before anything is updated; find_unused_parameters (and native DDP, ZeRO) train it like one
    process; a window whose every last backward reaches every parameter is no false positive."""
    ref = _train({}, EARLY_PLAN, MICRO_RUN, MicroPlanGPT)
    ref_last = _train({}, LAST_PLAN, MICRO_RUN, MicroPlanGPT)
    cases = [(FIND, EARLY_PLAN), ({}, EARLY_PLAN), ({"parallel.zero_stage": 2}, EARLY_PLAN),
             (TORCH, LAST_PLAN), ({**TORCH, "parallel.bucket_mb": 0.01}, LAST_PLAN),
             (TORCH, EARLY_PLAN), ({**TORCH, "parallel.bucket_mb": 0.01}, EARLY_PLAN)]  # refused: last
    runs = run_ranks(_micro_cases, 2, cases, join_timeout_s=300)
    early = [k for k in ref["init"] if k.startswith("transformer.h.1.")]
    assert early and all(not np.array_equal(ref["snaps"][0][0][k], ref["init"][k]) for k in early)  # trained at step 1
    for k in early:  # step 3 (unused): frozen in the reference
        np.testing.assert_array_equal(ref["snaps"][2][0][k], ref["snaps"][1][0][k])
    for (lay, plan), out in zip(cases[:-2], runs[0][:-2]):
        what = f"{lay} {'early' if plan is EARLY_PLAN else 'last'}"
        assert "error" not in out, (what, out.get("error"))
        r = ref if plan is EARLY_PLAN else ref_last
        _compare(r, out, what)
        assert {k: v["step"] for k, v in out["state"].items()} == {k: v["step"] for k, v in r["state"].items()}, what
    for i in range(len(cases) - 2):  # replicas identical
        np.testing.assert_array_equal(runs[0][i]["norms"], runs[1][i]["norms"])
        for k, v in runs[0][i]["params"].items():
            np.testing.assert_array_equal(runs[1][i]["params"][k], v, err_msg=f"{cases[i][0]} {k}")
    for r in (0, 1):
        for out in runs[r][-2:]:
            err = out.get("error", "")
            assert err.startswith("parameter transformer.h.1.") and "in the last micro-batch" in err, err
            assert "parallel.find_unused_parameters = true" in err and "parallel.dp_impl = native" in err, err
            assert "\n" not in err, err
            assert out["step"] == 0 and out["opt_state"] == 0, out["step"]
            for k, v in ref["init"].items():  # nothing applied: every parameter at its initial value
                np.testing.assert_array_equal(out["at_error"][k], v, err_msg=k)


def _cross(path):
    """CROSS_PLAN under torch DDP: each rank writes how it ended to ``path``/rank<r>, then re-raises."""
    import torch.distributed as dist

    rank, msg = dist.get_rank(), "no error"
    try:
        out = _train(TORCH, CROSS_PLAN, MICRO_RUN, MicroPlanGPT)
        if "error" in out:  # (_train returns a ConfigError as a result)
            msg = f"ConfigError: {out['error']}"
            raise ValueError(msg)
    except BaseException as e:
        msg = msg if isinstance(e, ValueError) else f"{type(e).__name__}: {e}".splitlines()[0]
        raise
    finally:
        with open(f"{path}/rank{rank}", "w") as f:
            f.write(msg)


def test_torch_ddp_unused_on_one_rank_fails_cleanly(tmp_path):
    """A parameter used in rank 0's last micro-batch but not in rank 1's: torch DDP has launched on
    rank 0 a bucket reduction that rank 1 never will (rank 0 waits for it inside backward). Rank 1
    raises the ConfigError; rank 0 fails as soon as rank 1's process is gone -- no hang."""
    with pytest.raises(RuntimeError) as info:
        run_ranks(_cross, 2, str(tmp_path), timeout_s=120, join_timeout_s=120)
    assert "ConfigError: parameter transformer.h.1." in str(info.value), str(info.value)[-2000:]
    one = (tmp_path / "rank1").read_text()
    assert one.startswith("ConfigError: parameter transformer.h.1.") and "in the last micro-batch" in one, one
    zero = tmp_path / "rank0"  # written within run_ranks' 5 s join after rank 1's error (60 s timeout not reached)
    assert zero.exists() and zero.read_text() != "no error", zero.read_text() if zero.exists() else "rank 0 hung"


def test_find_unused_parameters_config():
    from zerotron.config import ConfigError
    from zerotron.plan import build_plan

    with pytest.raises(ConfigError, match="applies to parallel.dp_impl = torch with zero_stage = 0 only"):
        build_plan(tiny_config({"parallel.find_unused_parameters": "true"}), 2)
    assert build_plan(tiny_config({"parallel.find_unused_parameters": "true", "parallel.dp_impl": "torch"}), 2).dp == 2
