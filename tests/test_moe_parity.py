"""The Mixtral-style MoE family under the parallel layouts, fp64 against one process (rtol 1e-10).

The generated matrix (test_parity_matrix.py) runs gpt2 and llama; a third family there would add
its whole covering array to CI. The MoE family runs here instead, on witnesses of every composition
the plan accepts for it: native DDP, torch DDP, ZeRO-1/3, FSDP2, tp (no SP), a 1F1B pipeline, full
recomputation, and expert parallelism (ep 2 and 4 over dp 2 and 4, DDP and ZeRO-1). The auxiliary
losses are on (weights 0.1 and 0.01) and enter the gradients, so a layout that took them over other
token sets, weighed them differently or synchronised expert gradients over the wrong group fails.
Every layout runs at the same ``train.micro_batch`` (2): the load-balancing loss is per micro-batch.
``ZEROTRON_MOE_PARITY=full`` adds more layouts (slow).
"""
import json
import os

import pytest
import torch

from zerotron import parity
from zerotron.testing import run_ranks

MOE = {"model.arch": "mixtral", "model.n_layer": 4, "model.n_kv_head": 2, "model.intermediate_size": 24,
       "model.n_experts": 4, "model.experts_top_k": 2, "model.moe_aux_loss_coef": 0.1,
       "model.moe_z_loss_coef": 0.01, "model.rope_theta": 10000.0, "train.micro_batch": 2}
L = parity.Layout
FULL = os.environ.get("ZEROTRON_MOE_PARITY") == "full"
# (layout, ep) at 2 processes in the default suite: recomputation under ZeRO-3, a 1F1B pipeline, and
# expert parallelism under DDP and ZeRO-1; the rest with ZEROTRON_MOE_PARITY=full (make test-moe)
W2 = [(L("zero3", 2, 1, False, 1, None, 4, ac="full"), 1), (L("ddp", 1, 1, False, 2, "1f1b", 4, split="even"), 1),
      (L("ddp", 2, 1, False, 1, None, 4), 2), (L("zero1", 2, 1, False, 1, None, 4), 2)]
W4 = []
if FULL:
    W2 += [(L("ddp", 2, 1, False, 1, None, 4), 1), (L("zero1", 2, 1, False, 1, None, 4), 1),
           (L("ddp", 1, 2, False, 1, None, 4), 1), (L("torch_ddp", 2, 1, False, 1, None, 4), 1),
           (L("zero2", 2, 1, False, 1, None, 4), 1)]
    W4 += [(L("ddp", 4, 1, False, 1, None, 2), 2), (L("ddp", 4, 1, False, 1, None, 1), 4),
           (L("zero1", 4, 1, False, 1, None, 2), 2), (L("ddp", 2, 2, False, 1, None, 4), 1),
           (L("zero3", 2, 1, False, 2, "1f1b", 4, split="even"), 1)]


@pytest.fixture(scope="module")
def moe_ref(data_cache, single_process, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_parity")
    extra = {"data.cache_dir": data_cache, **MOE}
    ref = parity.reference(str(tmp / "ref"), extra)
    assert any(".mlp.experts.gate_proj" in k for k in ref["params"])
    recs = [json.loads(ln) for ln in open(tmp / "ref" / "metrics.jsonl") if ln.strip()]
    for r in recs:  # the router's metrics (aux ~ k = 2 near balance; one load ratio per layer)
        assert 1.5 < r["moe_aux_loss"] < 4 and r["moe_z_loss"] > 0, r
        assert len(r["moe_load_max_mean"]) == 4 and all(v >= 1 for v in r["moe_load_max_mean"]), r
    path = str(tmp / "ref.pt")
    torch.save(ref, path)
    return tmp, extra, path, (set(ref["params"]), set(ref["optim"]))


def _run(world, items, moe_ref):
    """Train each (layout, ep) of ``items`` on ``world`` ranks (one spawn) and check it."""
    tmp, extra, path, keys = moe_ref
    jobs = [([lay.as_dict()], path, str(tmp / f"{lay.name}-ep{ep}"), {**extra, "parallel.ep": ep}) for lay, ep in items]
    per_rank = run_ranks(parity.run_jobs, world, jobs, timeout_s=120, join_timeout_s=120 * len(jobs) + 300)
    out = []
    for j, (lay, ep) in enumerate(items):
        recs = [per_rank[r][j][0] for r in range(world)]
        # expert-parallel: expert tensors are keyed by their ep range (ep_shard), i.e. really sharded
        assert any(k[2] == ("ep", 0, ep) for k in recs[0]["copies"]) == (ep > 1), lay.name
        out.append({**parity.check(lay.name, recs, keys, parity.FP64_RTOL), "ep": ep})
    return out


def test_moe_layouts_match_one_process(moe_ref, report):
    """Every (layout, ep) of W2 (and W4 in the full mode) trains like one process."""
    res = _run(2, W2, moe_ref) + (_run(4, W4, moe_ref) if W4 else [])
    for ep in sorted({r["ep"] for r in res}):
        sub = [r for r in res if r["ep"] == ep]
        worst = max(max(r[k] for k in parity.ERRORS) for r in sub)
        report(f"moe parity (ep {ep}): {', '.join(r['name'] for r in sub)}: worst relative error {worst:.3g}")


def _one_step(tmp, extra, ep):
    """One step of the dp 2 layout at ``ep``: this rank's all-to-all bytes and expert state bytes."""
    from zerotron.train.trainer import Trainer

    cfg = parity.config_for(L("ddp", 2, 1, False, 1, None, 4), {**extra, "parallel.ep": ep, "train.steps": 1})
    tr = Trainer(cfg, f"{tmp}/bytes-ep{ep}")
    recs = []
    tr.fit(callback=lambda t, r: recs.append(r))
    experts = [p for n, p in tr.strategy.module.named_parameters() if ".experts." in n]
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(nb(p) for p in experts) + sum(nb(t) for p in experts for t in tr.optimizer.state[p].values()
                                              if t.dim() > 0)
    return recs[0]["comm_bytes_by_op"].get("all_to_all/ep", 0), state, recs[0]["model_state_bytes"]


def test_expert_parallel_bytes_and_memory(moe_ref, report):
    """The all-to-all bytes of one step (comm accounting, summed over the ep group) equal the
    formula n_layer * micro-batches * (4 * rows * k * C * 8 + E * 8): dispatch and combine in the
    forward and again in the backward, each moving every token's k rows once; the counts (E int64)
    once per forward. Expert parameter + Adam bytes per rank halve from ep 1 to ep 2 (dp 2)."""
    tmp, extra, _, _ = moe_ref
    ep1 = run_ranks(_one_step, 2, str(tmp), extra, 1, timeout_s=120)
    ep2 = run_ranks(_one_step, 2, str(tmp), extra, 2, timeout_s=120)
    n_layer, E, k, C = 4, 4, 2, 32
    rows, micro_batches = 2 * 16, 16 // 2  # micro_batch x block_size; global_batch / micro_batch
    want = n_layer * micro_batches * (4 * rows * k * C * 8 + E * 8)
    got = sum(b for b, _, _ in ep2)
    assert got == want and all(b == 0 for b, _, _ in ep1), (got, want)
    assert all(s2 * 2 == s1 for (_, s1, _), (_, s2, _) in zip(ep1, ep2)), (ep1, ep2)
    report(f"moe ep 2 (dp 2): all-to-all {got} bytes per step = formula; expert params + Adam per rank "
           f"{ep1[0][1]} -> {ep2[0][1]} bytes; model state per rank {ep1[0][2]} -> {ep2[0][2]} bytes")
