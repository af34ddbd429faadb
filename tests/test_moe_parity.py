"""The Mixtral-style MoE family under the parallel layouts, fp64 against one process (rtol 1e-10).

The family's layout space is the matrix's (``parity.moe_layouts``: the dense factors with ``acc``
fixed by ``train.micro_batch`` 2, the load-balancing loss being per micro-batch, times ep in {1, 2,
4}); the plan refuses what cannot run for a documented reason (``parity.moe_expected_refusal``,
checked in both directions). The default suite trains the witnesses ``parity.MOE_MUST`` (ZeRO-3 with
recomputation, a 1F1B pipeline, FSDP2, ep 2 under DDP, ZeRO-1, ZeRO-3 and ZeRO-2 over 2 expert
replicas, FSDP2 stage 3 and torch DDP, ep 2 over a cp pair under ZeRO-1 (ring) and FSDP2 (all-to-all));
``ZEROTRON_MOE_PARITY=full`` or ``ZEROTRON_MATRIX=full``
(``make test-moe``) adds ``parity.MOE_MUST_FULL`` (FSDP2 over 2 expert replicas, native HSDP with
ep, FSDP2 x tp with ep, ep over dp x cp incl. under a pipeline) and a pairwise covering array of the valid MoE layouts with ep as a factor (slow). The auxiliary losses
are on (weights 0.1 and 0.01) and enter the gradients, so a layout that took them over other token
sets, weighed them differently or synchronised expert gradients over the wrong group fails.
``ZEROTRON_MOE_PARITY=ep`` (``make test-moe-ep``, about 80 min on 2 idle cores) trains every valid
layout with ep > 1 instead of the covering array (resumable with ``ZEROTRON_MATRIX_OUT``).
``ZEROTRON_MATRIX_NAMES`` selects layouts by name as for the dense matrix.
"""
import json
import os
import time
from collections import defaultdict

import pytest
import torch

from zerotron import parity
from zerotron.models import registry
from zerotron.testing import run_ranks

EVERY_EP = os.environ.get("ZEROTRON_MOE_PARITY") == "ep"  # every valid layout with ep > 1
FULL = EVERY_EP or "full" in (os.environ.get("ZEROTRON_MOE_PARITY"), os.environ.get("ZEROTRON_MATRIX"))
NAMES = [s.strip() for s in os.environ.get("ZEROTRON_MATRIX_NAMES", "").split(",") if s.strip()]
L = parity.Layout


@pytest.fixture(scope="module")
def moe_space():
    """(valid, {refused layout: message}) of the MoE family's layouts on at most 4 processes (full
    mode), or (default, ~5 s of plans) of those on at most 2 the dense matrix accepts (the dense
    refusals are test_parity_matrix's) plus the witnesses."""
    valid, refused = [], {}
    space = parity.moe_layouts(4)
    if not FULL:
        space = [l for l in space if (l.world <= 2 and parity.expected_refusal(l) is None) or l.name in parity.MOE_MUST]
    for lay in space:
        why = parity.moe_refusal(lay)
        if why is None:
            valid.append(lay)
        else:
            refused[lay] = why
    return valid, refused


def test_moe_refusals_are_the_documented_ones(moe_space, report):
    """The plan refuses exactly the MoE layouts with a documented reason (both directions), each in one line."""
    valid, refused = moe_space
    wrong = [l.name for l in valid if parity.moe_expected_refusal(l)][:5]
    assert not wrong, f"accepted although documented as refused: {wrong}"
    wrong = [(l.name, m) for l, m in refused.items() if not parity.moe_expected_refusal(l)][:3]
    assert not wrong, f"refused without a documented reason: {wrong}"
    assert all("\n" not in m for m in refused.values())
    assert {n for n in (parity.MOE_MUST_FULL if FULL else parity.MOE_MUST)} <= {l.name for l in valid}
    report(f"moe layout space ({'<= 4' if FULL else 'dense-valid <= 2'} processes + witnesses, ep 1/2/4): "
           f"{len(valid)} valid, {len(refused)} refused as documented")


@pytest.fixture(scope="module")
def moe_ref(data_cache, single_process, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_parity")
    extra = {"data.cache_dir": data_cache, **parity.MOE_MODEL}
    ref = parity.reference(str(tmp / "ref"), extra)
    assert any(".mlp.experts.gate_proj" in k for k in ref["params"])
    recs = [json.loads(ln) for ln in open(tmp / "ref" / "metrics.jsonl") if ln.strip()]
    n_layer = parity.MOE_MODEL["model.n_layer"]
    for r in recs:  # the router's metrics (aux ~ k = 2 near balance; one load ratio per layer)
        assert 1.5 < r["moe_aux_loss"] < 4 and r["moe_z_loss"] > 0, r
        assert len(r["moe_load_max_mean"]) == n_layer and all(v >= 1 for v in r["moe_load_max_mean"]), r
    path = str(tmp / "ref.pt")
    torch.save(ref, path)
    return tmp, extra, path, (set(ref["params"]), set(ref["optim"]))


CHUNK = 24  # layouts per spawn: a hung or crashed spawn costs one chunk, progress is saved per chunk


def _run(world, items, moe_ref, progress=None):
    """Train the layouts ``items`` on ``world`` ranks (one spawn per CHUNK layouts) and check each: a
    summary per layout, with ``"error"`` (the check's first line) for one that fails, so one failure
    does not hide the others' results. ``progress``: a JSON-lines file each chunk's summaries are
    appended to."""
    tmp, extra, path, keys = moe_ref
    out = []
    for c in range(0, len(items), CHUNK):
        part = items[c:c + CHUNK]
        jobs = [([lay.as_dict() for lay in part], path, str(tmp / f"w{world}-{c}"), extra)]
        t0 = time.time()
        per_rank = run_ranks(parity.run_jobs, world, jobs, timeout_s=120, join_timeout_s=120 * len(part) + 300)
        seconds = round((time.time() - t0) / len(part), 2)  # chunk time per layout
        new = []
        for i, lay in enumerate(part):
            recs = [per_rank[r][0][i] for r in range(world)]
            assert all(rec["name"] == lay.name for rec in recs)
            try:
                if lay.sync != "zero3":  # expert tensors keyed by their ep range (ep_shard): really sharded
                    assert any(isinstance(k[2], tuple) and k[2][:3] == ("ep", 0, lay.ep)
                               for k in recs[0]["copies"]) == (lay.ep > 1), f"{lay.name}: expert tensors' ep sharding"
                res = parity.check(lay.name, recs, keys, parity.FP64_RTOL)
            except AssertionError as e:
                res = {"name": lay.name, "world": world, "error": str(e).splitlines()[0],
                       **{k: max(r[k] for r in recs) for k in parity.ERRORS}}
            new.append({**res, "ep": lay.ep, "seconds": seconds})
        if progress:
            with open(progress, "a") as f:
                f.writelines(json.dumps(x) + "\n" for x in new)
        out += new
    return out


def test_moe_layouts_match_one_process(moe_space, moe_ref, report):
    """Every chosen MoE layout (the witnesses; in the full mode a covering array) trains like one
    process. ``ZEROTRON_MATRIX_OUT=path.json`` writes the per-layout worst errors (and a Markdown
    table beside it); an interrupted run resumes from ``path.partial.jsonl``, checking only the rest
    (and the layouts that failed there)."""
    valid, refused = moe_space
    if EVERY_EP:
        chosen = [l for l in valid if l.ep > 1]
    elif FULL:
        chosen = parity.covering_layouts(valid, must=parity.MOE_MUST_FULL, extra_keys=("ep",))
    else:
        chosen = [l for l in valid if l.name in parity.MOE_MUST]
    if NAMES:
        chosen = [l for l in chosen if any(n in l.name for n in NAMES)]
    out = os.environ.get("ZEROTRON_MATRIX_OUT")
    progress = os.path.splitext(out)[0] + ".partial.jsonl" if out else None
    done = {k: r for k, r in (parity.read_progress(progress) if progress else {}).items() if "error" not in r}  # rerun failures
    by_world = defaultdict(list)
    for lay in chosen:
        if lay.name not in done:
            by_world[lay.world].append(lay)
    res = [done[lay.name] for lay in chosen if lay.name in done]
    res += [r for w, lays in sorted(by_world.items()) for r in _run(w, lays, moe_ref, progress)]
    assert len(res) == len(chosen)
    for ep in sorted({r["ep"] for r in res}):
        sub = [r for r in res if r["ep"] == ep]
        worst = max(max(r[k] for k in parity.ERRORS) for r in sub)
        report(f"moe parity (ep {ep}): {len(sub)} layouts ({', '.join(r['name'] for r in sub[:8])}"
               f"{', ...' if len(sub) > 8 else ''}): worst relative error {worst:.3g}")
    failed = [r for r in res if "error" in r]
    if out and not NAMES:
        summary = {"model": "mixtral (parity.MOE_MODEL)", "mode": ("every layout with ep > 1" if EVERY_EP else "covering array, ep as a factor") if FULL else "witnesses",
                   "valid": len(valid), "refused": len(refused), "checked": len(res), "failed": len(failed),
                   "worst": {k: max(r[k] for r in res) for k in parity.ERRORS},
                   "seconds": round(sum(r.get("seconds", 0) for r in res), 1),
                   "layouts": sorted(res, key=lambda r: (r["world"], r["name"])),
                   "refusals": {lay.name: m for lay, m in sorted(refused.items())}}
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(parity.markdown(summary).replace("# Parity matrix", "# MoE parity matrix", 1))
        if not failed and os.path.exists(progress):
            os.remove(progress)
    assert not failed, f"{len(failed)} of {len(res)} MoE layouts differ from one process: " + "; ".join(
        r["error"] for r in failed[:5])


def _one_step(tmp, extra, ep, recompute="none"):
    """One step of the dp 2 layout at ``ep`` (``recompute``: train.activation_checkpointing): this
    rank's all-to-all bytes, expert state bytes and model state bytes."""
    from zerotron.train.trainer import Trainer

    cfg = parity.config_for(L("ddp", 2, 1, False, 1, None, 4, ep=ep),
                            {**extra, "train.steps": 1, "train.activation_checkpointing": recompute})
    tr = Trainer(cfg, f"{tmp}/bytes-ep{ep}-{recompute}")
    recs = []
    tr.fit(callback=lambda t, r: recs.append(r))
    experts = [p for n, p in tr.strategy.module.named_parameters() if ".experts." in n]
    nb = lambda t: t.numel() * t.element_size()  # noqa: E731
    state = sum(nb(p) for p in experts) + sum(nb(t) for p in experts for t in tr.optimizer.state[p].values()
                                              if t.dim() > 0)
    return recs[0]["comm_bytes_by_op"].get("all_to_all/ep", 0), state, recs[0]["model_state_bytes"]


def _steps(tmp, extra, runs):
    """:func:`_one_step` for each ``(ep, recompute)`` of ``runs`` in one spawn."""
    return [_one_step(tmp, extra, *r) for r in runs]


def test_expert_parallel_bytes_and_memory(moe_ref, report):
    """The all-to-all bytes of one step (comm accounting, summed over the ep group) equal the
    formula n_layer * micro-batches * (4 * rows * k * C * 8 + E * 8): dispatch and combine in the
    forward and again in the backward, each moving every token's k rows once; the counts (E int64)
    once per forward -- with full recomputation (the forward again in the backward) 6 exchanges and
    the counts twice; both as ``analysis.moe_memory.moe_all_to_all_bytes`` (what ``zerotron memory --ep``
    and ``zerotron plan`` price) has them. Expert parameter + Adam bytes per rank halve from ep 1 to
    ep 2 (dp 2)."""
    from zerotron.analysis.moe_memory import moe_all_to_all_bytes

    tmp, extra, _, _ = moe_ref
    (ep1,), (ep2, ep2_full) = (list(zip(*run_ranks(_steps, 2, str(tmp), extra, runs, timeout_s=120)))
                               for runs in ([(1, "none")], [(2, "none"), (2, "full")]))
    n_layer, E, k, C = parity.MOE_MODEL["model.n_layer"], 4, 2, parity.MODEL["model.n_embd"]
    rows, micro_batches = 2 * 16, 16 // 2  # micro_batch x block_size; global_batch / micro_batch
    want = n_layer * micro_batches * (4 * rows * k * C * 8 + E * 8)
    want_full = n_layer * micro_batches * (6 * rows * k * C * 8 + 2 * E * 8)
    got, got_full = sum(b for b, _, _ in ep2), sum(b for b, _, _ in ep2_full)
    shape = registry.config_from_section(parity.config_for(L("ddp", 1, 1, False, 1, None, 8), extra).model, 256)
    # per rank (its micro_batches / 2), summed over the 2 ranks of the ep group
    est = [2 * moe_all_to_all_bytes(shape, n_layer, rows, micro_batches // 2, 8, rec) for rec in ("none", "full")]
    assert got == want == est[0] and all(b == 0 for b, _, _ in ep1), (got, want, est)
    assert got_full == want_full == est[1], (got_full, want_full, est)
    assert all(s2 * 2 == s1 for (_, s1, _), (_, s2, _) in zip(ep1, ep2)), (ep1, ep2)
    report(f"moe ep 2 (dp 2): all-to-all {got} bytes per step = formula ({got_full} with full recomputation); "
           f"expert params + Adam per rank {ep1[0][1]} -> {ep2[0][1]} bytes; model state per rank {ep1[0][2]} -> "
           f"{ep2[0][2]} bytes")


def _ckpt_run(run_dir, lay, extra, resume):
    """Train ``lay`` for 3 steps (a checkpoint after each) or resume it; losses and final canonical params."""
    from zerotron.train.trainer import Trainer

    cfg = parity.config_for(lay, {**extra, "train.steps": 3, "checkpoint.every": 1, "checkpoint.keep": 0})
    tr = Trainer(cfg, run_dir, resume=resume)
    losses = []
    tr.fit(callback=lambda t, r: losses.append(r["loss"]))
    msd, _ = tr.strategy.state_dict(tr.optimizer)
    # numpy, pickled by value: a rank that retires after the job (``testing``: too many threads left,
    # e.g. after FSDP2) exits before the caller could fetch a tensor shared by file descriptor
    return losses, {k: v.detach().double().cpu().numpy().copy() for k, v in msd.items()}


def test_expert_parallel_checkpoint_reshards(moe_ref, report):
    """A ZeRO-2 dp 4 = ep 2 x 2 replicas checkpoint of step 2 resumes under DDP at ep 4, under
    ZeRO-3 at ep 1 (dp 2) and under ZeRO-1 at dp 1 x cp 2 = ep 2 -- in the full mode also under FSDP2 stage 2 at dp 4 ep 2 and torch DDP at
    dp 2 ep 2: step 3's loss and the final parameters equal the uninterrupted run's."""

    tmp, extra, _, _ = moe_ref
    src = tmp / "ckpt-ep2"
    full_losses, full_params = run_ranks(_ckpt_run, 4, str(src), L("zero2", 4, 1, False, 1, None, 2, ep=2),
                                         extra, False, timeout_s=120)[0]
    full_params = {k: torch.from_numpy(v) for k, v in full_params.items()}
    worst = 0.0
    # ... and under context parallelism as ep 2 over the cp pair (dp 1 x cp 2, ring attention)
    targets = [L("ddp", 4, 1, False, 1, None, 2, ep=4), L("zero3", 2, 1, False, 1, None, 4),
               L("zero1", 1, 1, False, 1, None, 8, cp=2, cp_impl="ring", ep=2)]
    if FULL:  # FSDP2 with experts over dp/ep (its full-state checkpoint), torch DDP at ep 2
        targets += [L("fsdp2_2", 4, 1, False, 1, None, 2, ep=2), L("torch_ddp", 2, 1, False, 1, None, 4, ep=2)]
    for lay in targets:
        worst = max(worst, _resume_matches(src, tmp / f"resume-{lay.name}", lay, extra, full_losses, full_params,
                                           lambda per_rank: per_rank[0]))
    report(f"moe checkpoint: zero2 dp4 ep2 step 2 resumed as {', '.join(l.name for l in targets)}: step-3 loss and "
           f"final params equal, worst relative error {worst:.3g}")


def test_expert_parallel_checkpoint_reshards_under_pp(moe_ref, report):
    """(``make test-moe``) A ZeRO-1 pp 2 x dp 2 = ep 2 (1F1B) checkpoint of step 2 resumes as DDP
    dp 4 at ep 4 (no pipeline) and as DDP pp 2 x ep 2 under ZB-H1: step 3's loss and the final
    parameters equal the uninterrupted run's (the pipeline ranks' canonical parts merged)."""

    if not FULL:
        pytest.skip("three 4-rank spawns: ZEROTRON_MOE_PARITY=full (make test-moe)")
    tmp, extra, _, _ = moe_ref

    def merged(per_rank):
        losses = per_rank[-1][0]  # the last pipeline stage's rank reports the loss (all do: reduced)
        params = {}
        for _, p in per_rank:
            params.update(p)
        return losses, params

    src = tmp / "ckpt-pp2-ep2"
    full_losses, full_params = merged(run_ranks(_ckpt_run, 4, str(src), L("zero1", 2, 1, False, 2, "1f1b", 4, "auto",
                                                                         ep=2), extra, False, timeout_s=120))
    worst = 0.0
    for lay in (L("ddp", 4, 1, False, 1, None, 2, ep=4), L("ddp", 2, 1, False, 2, "zb-h1", 4, "auto", ep=2)):
        worst = max(worst, _resume_matches(src, tmp / f"resume-pp-{lay.name}", lay, extra, full_losses,
                                           {k: torch.from_numpy(v) for k, v in full_params.items()}, merged))
    report(f"moe checkpoint under pp: zero1 pp2 dp2 ep2 step 2 resumed as ddp dp4 ep4 and ddp pp2 ep2 zb-h1: "
           f"step-3 loss and final params equal, worst relative error {worst:.3g}")


def _resume_matches(src, dst, lay, extra, full_losses, full_params, per_rank) -> float:
    """Resume the step-2 checkpoint of ``src`` as layout ``lay`` (in ``dst``): step 3's loss and the final
    parameters equal the uninterrupted run's (rtol 1e-10). ``per_rank`` turns run_ranks' results into
    (losses, {name: numpy}). Returns the worst relative error."""
    import shutil

    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != "step_2"])
    losses, params = per_rank(run_ranks(_ckpt_run, lay.world, str(dst), lay, extra, True, timeout_s=120))
    params = {k: torch.from_numpy(v) for k, v in params.items()}
    assert len(losses) == 1 and abs(losses[0] - full_losses[2]) <= 1e-10 * abs(full_losses[2]), (lay.name, losses)
    assert set(params) == set(full_params)
    err = max(float((params[k] - v).norm() / v.norm().clamp_min(1e-300)) for k, v in full_params.items())
    assert err <= 1e-10, (lay.name, err)
    return max(err, abs(losses[0] - full_losses[2]) / abs(full_losses[2]))
