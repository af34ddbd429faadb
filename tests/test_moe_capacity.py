"""Capacity mode and auxiliary-loss-free balancing of the MoE family (``model.moe_capacity_factor``,
``model.moe_bias_update_rate``): the drop rule against a hand-written loop, the bias rule, and
dp 2 (ep 1 and ep 2) trained with both on equal to one process in fp64 (the bias moves by the
global load, the capacity is per forward of ``train.micro_batch`` rows on every layout)."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from zerotron import parity
from zerotron.models.mixtral import MixtralConfig
from zerotron.models.moe import MoE, take_router_stats, update_expert_bias
from zerotron.testing import run_ranks

FULL = os.environ.get("ZEROTRON_MOE_PARITY") == "full"  # make test-moe: the slow checks too
full_only = pytest.mark.skipif(not FULL, reason="slow: ZEROTRON_MOE_PARITY=full (make test-moe)")

SMALL = dict(vocab_size=61, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=24)


def test_capacity_drop_rule_and_bias_selection():
    """Capacity C = ceil(f * N * k / E): each expert keeps its first C assignments in (token, slot)
    order, computed here token by token; eval forwards stay dropless; the bias shifts the top-k
    selection, not the weights; update_expert_bias moves by rate * sign(mean - load)."""
    torch.manual_seed(0)
    cfg = MixtralConfig(**SMALL, n_experts=4, experts_top_k=2, moe_capacity_factor=0.75, moe_bias_update_rate=0.1)
    moe = MoE(cfg).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.5, -0.5, 0.0]))
    x = torch.randn(3, 5, cfg.n_embd, dtype=torch.float64)
    h = x.reshape(-1, cfg.n_embd)
    logits = moe.gate(h)
    N, k, E = h.size(0), 2, 4
    cap = math.ceil(0.75 * N * k / E)
    seen, want, dropped = [0] * E, torch.zeros_like(h), 0
    e = moe.experts
    for t in range(N):
        idx = torch.topk(logits[t] + moe.expert_bias, k).indices
        w = F.softmax(logits[t][idx], -1)  # weights of the unbiased logits
        for j, i in enumerate(idx.tolist()):
            seen[i] += 1
            if seen[i] > cap:
                dropped += 1
                continue
            want[t] += w[j] * ((F.silu(e.gate_proj[i] @ h[t]) * (e.up_proj[i] @ h[t])) @ e.down_proj[i].t())
    moe.train()
    out = moe(x).reshape(-1, cfg.n_embd)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert dropped > 0 and moe.dropped == dropped
    d = torch.zeros(1)
    stats = take_router_stats(moe, 1, E, d)
    assert d.item() == dropped and moe.dropped == 0
    assert stats[0, :E].sum() == N * k  # the routing decisions, before the drop
    moe.eval()  # dropless at inference
    with torch.no_grad():
        full = moe(x)
    assert moe.dropped == 0 and not torch.allclose(full.reshape(-1, cfg.n_embd), out)
    before = moe.expert_bias.clone()
    counts = torch.tensor([[10.0, 2.0, 4.0, 4.0]])  # mean 5
    update_expert_bias(moe, counts)
    torch.testing.assert_close(moe.expert_bias - before, torch.tensor([-0.1, 0.1, 0.1, 0.1], dtype=torch.float64))


@pytest.mark.parametrize("field,value", [("moe_capacity_factor", -1.0), ("moe_bias_update_rate", float("inf"))])
def test_bad_values_refused(field, value):
    with pytest.raises(ValueError, match=field):
        MixtralConfig(**SMALL, **{field: value}).validate()


MOE = {"model.arch": "mixtral", "model.n_layer": 2, "model.n_kv_head": 2, "model.intermediate_size": 24,
       "model.n_experts": 4, "model.experts_top_k": 2, "model.moe_aux_loss_coef": 0.0,
       "model.rope_theta": 10000.0, "train.micro_batch": 2, "model.moe_capacity_factor": 1.0,
       "model.moe_bias_update_rate": 0.05}


@full_only
def test_capacity_and_bias_dp_and_ep_equal_one_process(data_cache, single_process, tmp_path, report):
    """dp 2 with ep 1 and ep 2 (DDP), capacity 1.0 and bias rate 0.05 on, equal one process (losses,
    grad norms, final parameters and Adam state, rtol 1e-10); tokens were dropped and the bias moved
    the routing (the loss differs from the run without the bias)."""
    extra = {"data.cache_dir": data_cache, **MOE}
    ref = parity.reference(str(tmp_path / "ref"), extra)
    recs = [json.loads(ln) for ln in open(tmp_path / "ref" / "metrics.jsonl") if ln.strip()]
    assert all(r["moe_dropped"] > 0 and 0 < r["moe_dropped_frac"] < 0.5 for r in recs), recs
    nobias = parity.reference(str(tmp_path / "nobias"), {**extra, "model.moe_bias_update_rate": 0.0})
    assert nobias["losses"][-1] != ref["losses"][-1]
    path = str(tmp_path / "ref.pt")
    torch.save(ref, path)
    keys = (set(ref["params"]), set(ref["optim"]))
    lay = parity.Layout("ddp", 2, 1, False, 1, None, 4)
    jobs = [([lay.as_dict()], path, str(tmp_path / f"ep{ep}"), {**extra, "parallel.ep": ep}) for ep in (1, 2)]
    per_rank = run_ranks(parity.run_jobs, 2, jobs, timeout_s=120, join_timeout_s=600)
    worst = 0.0
    for j in range(len(jobs)):
        res = parity.check(f"ddp-dp2-ep{j + 1}", [per_rank[r][j][0] for r in range(2)], keys, parity.FP64_RTOL)
        worst = max(worst, max(res[k] for k in parity.ERRORS))
    report(f"moe capacity 1.0 + bias balancing: dp2 ep1/ep2 vs one process worst relative error {worst:.3g}; "
           f"dropped share {recs[-1]['moe_dropped_frac']:.3f} at the last step")


def _ep_step(tmp, extra):
    """One step of ZeRO-1 dp 2 ep 2: the model config, this rank's expert state bytes, model-state
    breakdown and all-to-all bytes."""
    from zerotron.train.trainer import Trainer

    cfg = parity.config_for(parity.Layout("zero1", 2, 1, False, 1, None, 4),
                            {**extra, "parallel.ep": 2, "train.steps": 1})
    tr = Trainer(cfg, f"{tmp}/mem-ep2")
    recs = []
    tr.fit(callback=lambda t, r: recs.append(r))
    return (tr.model_cfg, tr.strategy.expert_state_bytes(tr.optimizer)["total_bytes"], recs[0]["model_state_breakdown"],
            recs[0]["comm_bytes_by_op"].get("all_to_all/ep", 0))


def test_moe_estimator_equals_measured_ep_state_and_bytes(data_cache, tmp_path, report):
    """``analysis.moe_memory.moe_estimate`` (what ``zerotron memory --ep`` prints) against one measured
    step of ZeRO-1 dp 2 ep 2 in fp64: expert params + grads + Adam per rank equal, all-to-all bytes
    summed over the ep group equal ep x the estimate, the dense ZeRO-1 states within the flat
    buffers' padding."""
    from zerotron.analysis.moe_memory import moe_estimate

    extra = {"data.cache_dir": data_cache, **MOE, "model.moe_capacity_factor": 0.0}
    res = run_ranks(_ep_step, 2, str(tmp_path), extra, timeout_s=120)
    cfg = res[0][0]
    est = moe_estimate(cfg, dp=2, ep=2, stage=1, dtype="fp64", seq=cfg.block_size, micro_batch=2, microbatches=4)
    assert sum(r[3] for r in res) == 2 * est["all_to_all_bytes"], ([r[3] for r in res], est)  # mean per rank
    for _, expert, breakdown, a2a in res:
        assert expert == est["expert_state_bytes"], (expert, est)
        dense = breakdown["total_bytes"] - expert
        assert abs(dense - est["dense_state_bytes"]) <= 0.01 * est["dense_state_bytes"], (dense, est)
    report(f"moe estimator (ZeRO-1 dp2 ep2, fp64): expert states {est['expert_state_bytes']} B/rank = measured; "
           f"all-to-all {est['all_to_all_bytes']} B/rank/step = measured mean; dense {res[0][2]['total_bytes'] - res[0][1]} "
           f"measured vs {est['dense_state_bytes']} estimated")


def _bias_resume(tmp, extra, cases):
    """Per ``(name, layout, overrides)``: 3 fp64 steps with a checkpoint after each, then step 3
    again from the step-2 checkpoint (``step_3`` removed, ``resume``). Returns per case the step
    losses of both runs and both final canonical model states (numpy, pickled by value)."""
    import shutil

    import torch.distributed as dist

    from zerotron.train.trainer import Trainer

    out = {}
    for name, lay, over in cases:
        run_dir = f"{tmp}/{name}"
        cfg = parity.config_for(lay, {**extra, **over, "train.steps": 3, "checkpoint.every": 1, "checkpoint.keep": 0})
        got = []
        for resume in (False, True):
            if resume and dist.get_rank() == 0:
                shutil.rmtree(f"{run_dir}/checkpoints/step_3")
            dist.barrier()
            tr = Trainer(cfg, run_dir, resume=resume)
            losses = []
            tr.fit(callback=lambda t, r: losses.append(r["loss"]))
            msd, osd = tr.strategy.state_dict(tr.optimizer)
            got.append((losses, {k: v.detach().double().cpu().numpy().copy() for k, v in msd.items()}))
            dist.barrier()
        # and a full canonical state (load_state_dict, not DCP's in-place load) sets the bias too
        moved = {k: v + 1 if k.endswith("expert_bias") else v for k, v in msd.items()}
        tr.strategy.load_state_dict(moved, osd, tr.optimizer)
        back, _ = tr.strategy.state_dict(tr.optimizer)
        got.append(all(torch.equal(back[k], moved[k]) for k in moved if k.endswith("expert_bias")))
        out[name] = got
    return out


def test_bias_resumes_exactly_under_sharded_states(data_cache, tmp_path, report):
    """The balancing bias (``expert_bias``, a persistent buffer outside the parameters) is in the
    checkpoints of the strategies that build their own canonical state: a run resumed from step 2
    trains step 3 bitwise like the uninterrupted run, and both end with the same model state
    (the bias included, and moved), under native ZeRO-3 (and its asynchronous snapshot) and ZeRO-1
    with ep 2 (each lost the bias before: the resumed step-3 loss differed in the 5th digit); a full
    canonical state loaded with ``load_state_dict`` sets it too."""
    extra = {"data.cache_dir": data_cache, **MOE}
    cases = [("zero3", parity.Layout("zero3", 2, 1, False, 1, None, 4), {}),
             ("zero3-async", parity.Layout("zero3", 2, 1, False, 1, None, 4), {"checkpoint.async_save": "true"}),
             ("zero1-ep2", parity.Layout("zero1", 2, 1, False, 1, None, 4, ep=2), {})]
    per_rank = run_ranks(_bias_resume, 2, str(tmp_path), extra, cases, timeout_s=300)
    for name, *_ in cases:
        (full_losses, _), (losses, _), _ = per_rank[0][name]
        assert all(per_rank[r][name][2] for r in range(2)), name
        assert len(full_losses) == 3 and losses == full_losses[2:], (name, full_losses, losses)
        for r in range(2):
            (_, full), (_, resumed), _ = per_rank[r][name]
            bias = [k for k in full if k.endswith("expert_bias")]
            assert bias and full.keys() == resumed.keys(), (name, sorted(full))
            assert all(abs(full[k]).max() > 0 for k in bias), name
            for k in full:
                assert (full[k] == resumed[k]).all(), (name, k)
    report(f"moe bias resume: {', '.join(n for n, *_ in cases)} from step 2 equal the uninterrupted run bitwise "
           "(step-3 loss and final state, expert_bias included)")


def test_checkpoint_without_the_bias_still_loads(single_process, tmp_path, capsys):
    """A checkpoint that holds no ``expert_bias`` (written before sharded strategies saved
    persistent buffers, or by a model trained with the rate 0) loads into a model with the bias:
    the parameters are the saved ones, the bias keeps its value, one note line names it."""
    from types import SimpleNamespace

    from zerotron.models.mixtral import Mixtral
    from zerotron.parallel.base import Strategy
    from zerotron.train.checkpoint import load_checkpoint, save_checkpoint

    cfg = dict(**SMALL, n_experts=4, experts_top_k=2)
    torch.manual_seed(0)
    old = Mixtral(MixtralConfig(**cfg))
    assert not any(n.endswith("expert_bias") for n in old.state_dict())
    ckpt = save_checkpoint(tmp_path, 1, Strategy(old), None, SimpleNamespace(state_dict=dict), {})
    torch.manual_seed(1)
    new = Mixtral(MixtralConfig(**cfg, moe_bias_update_rate=0.05))
    bias = {n: b for n, b in new.named_buffers() if n.endswith("expert_bias")}
    assert len(bias) == SMALL["n_layer"]
    for b in bias.values():
        b.fill_(0.25)
    load_checkpoint(ckpt, new, restore_rng=False)
    for n, p in old.state_dict().items():
        assert torch.equal(new.state_dict()[n], p), n
    assert all((b == 0.25).all() for b in bias.values())
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "expert_bias" in ln]
    assert len(notes) == 1 and notes[0].startswith("note:"), notes
