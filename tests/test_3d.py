"""3-D layouts through the real Trainer: pipeline x tensor parallel (with and without sequence
parallelism), pipeline x ZeRO-1 over dp, and pp2 x dp2 x tp2 on 8 processes train exactly like one
process on the same global batch; the tied
embedding/head copies of the first and last stage stay bitwise equal; checkpoints move between
pp2 x tp2 / pp2 x dp2 ZeRO-1 and one process in both directions.

Two spawns (4 and 8 processes); the dense reference and the 1-process resumes run in the pytest
process."""
import hashlib
import shutil

import numpy as np
import pytest
import torch

from zerotron import parity
from zerotron.analysis.memory import model_state_bytes, stage_num_params
from zerotron.testing import assert_params_close, run_ranks, tiny_config

STEPS, SAVE_AT = 4, 2
RTOL = 1e-10  # fp64: reassociation noise only, on any CPU
BASE = {"train.dtype": "fp64", "train.steps": STEPS, "train.global_batch": 8, "train.eval_every": STEPS,
        "checkpoint.save_final": "false",
        "train.grad_clip": 0.1, "checkpoint.every": SAVE_AT, "checkpoint.keep": 0}
PP2TP2 = {"parallel.pp": 2, "parallel.tp": 2}
ZERO = {"parallel.pp": 2, "parallel.zero_stage": 1}


def _digest(t) -> str:
    return hashlib.sha256(t.detach().double().clone().numpy().tobytes()).hexdigest()  # clone: numpy pins


def _train(overrides, run_dir, resume=False):
    """One Trainer run; returns losses/norms per step, digests of the tied copy (pipeline), the
    canonical (dense) final state, the dense state yielded by full_params(), and ZeRO shard sizes."""
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**BASE, **overrides})
    tr = Trainer(cfg, run_dir, resume=resume)
    s = tr.strategy
    out = {"losses": [], "norms": [], "tied": [], "val": {}, "coords": tr.mesh.coords}

    def cb(t, rec):
        out["losses"].append(rec["loss"])
        out["norms"].append(rec["grad_norm"])
        if "val_loss" in rec:  # evaluation at step 1 (fresh runs) and STEPS: pipelined forward only
            out["val"][rec["step"]] = rec["val_loss"]
        tied = getattr(t.strategy, "tied", None)
        zero = getattr(t.strategy, "zero", None)
        if tied is not None and zero is not None and zero.stage == 3:  # sharded at rest: its dp shard
            tied = next(f.master for f in zero.all_flats if f.is_tied)
        out["tied"].append(None if tied is None else _digest(tied))

    tr.fit(callback=cb)
    msd, osd = s.state_dict(tr.optimizer)
    out["params"] = {k: v.detach().double().numpy().copy() for k, v in msd.items()}
    out["optim_keys"] = sorted(osd["state"])
    out["optim_groups"] = [sorted(g["params"]) for g in osd["param_groups"]]
    prompt = torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])
    with s.full_params() as dense:
        out["full"] = {k: v.detach().double().numpy().copy() for k, v in dense.state_dict().items()}
        out["full_type"] = type(dense).__name__
        out["gen"] = [dense.generate(prompt, 6, temperature=0).tolist()]
    if hasattr(s, "executor"):  # pipelined greedy decoding (vocab-parallel logits gathered over tp)
        from zerotron.parallel.pipeline.generate import pipeline_generate

        out["gen"].append(pipeline_generate(s, prompt, 6).tolist())
    out["tp"] = s.tp_group is not None and s.tp_group.size() > 1
    zero = getattr(s, "zero", None)
    if zero is not None:
        out["ckpt_keys"] = sorted(s.checkpoint_state(tr.optimizer)[0])  # this dp rank's share
        st = [tr.optimizer.state[f.master] for f in zero.all_flats]
        out["state"] = (zero.stage, s.model_state_bytes(tr.optimizer)["total_bytes"], len(zero.all_flats),
                        stage_num_params(tr.model_cfg, pp=2, virtual_stages=len(s.split) // 2,
                                         layer_counts=list(s.split))[tr.mesh.coords["pp"]])
        out["zero"] = {"master": sum(f.master.numel() for f in zero.all_flats),
                       "padded": sum(f.padded for f in zero.all_flats),
                       "exp_avg": sum(x["exp_avg"].numel() for x in st), "dp": zero.group.size()}
    return out


def _many(tmp, cache, layouts):
    outs = []
    for i, lay in enumerate(layouts):
        lay = dict(lay)
        resume_from = lay.pop("resume_from", None)
        run = f"{tmp}/{lay.pop('name', f'run{i}')}"
        if resume_from:
            import torch.distributed as dist

            if dist.get_rank() == 0:
                _copy_until(resume_from, run, SAVE_AT)
            dist.barrier()
        outs.append(_train({**lay, "data.cache_dir": cache}, run, resume=bool(resume_from)))
    return outs


def _copy_until(src, dst, step):
    keep = f"step_{step}"
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != keep])


def _check_params(params, ref, what, subset=False):
    """Norm-wise per tensor; ``subset``: ``params`` may hold only some keys (one pipeline stage)."""
    assert_params_close(params, ref, RTOL, what, subset)


def _check(ref, runs, layouts, pp=2):
    """Every rank of every layout against the dense reference (from step SAVE_AT when resumed)."""
    tied_model = ref["family"] == "gpt2"  # GPT-2 ties its head to the embedding; the Llama preset not
    for i, lay in enumerate(layouts):
        outs = [r[i] for r in runs]
        start = SAVE_AT if lay.get("resume_from") else 0
        for o in outs:  # every rank: the same global loss and norm, equal to one process
            np.testing.assert_allclose(o["losses"], ref["losses"][start:], rtol=RTOL, err_msg=str(lay))
            np.testing.assert_allclose(o["norms"], ref["norms"][start:], rtol=RTOL, err_msg=str(lay))
            assert o["norms"] == outs[0]["norms"] and o["losses"] == outs[0]["losses"], lay
            assert STEPS in o["val"] and (start or 1 in o["val"]), lay
            for step, v in o["val"].items():
                np.testing.assert_allclose(v, ref["val"][step], rtol=RTOL, err_msg=f"{lay} val loss {step}")
            _check_params(o["params"], ref["params"], f"{lay} rank {o['coords']}", subset=True)
            assert o["optim_groups"] == ref["optim_groups"], lay  # canonical whole-model groups
            assert o["full_type"] == ref["full_type"], lay  # full_params() yields a dense model
            assert len(o["gen"]) == 2 and o["gen"][0] == o["gen"][1], lay  # pipeline == dense greedy
        by = {(o["coords"]["pp"], o["coords"]["dp"], o["coords"]["tp"]): o for o in outs}
        for (p, d, t), o in by.items():  # the stages' canonical states cover the dense model, and
            merged = {}                  # full_params() holds exactly them on every rank
            for q in range(pp):
                merged.update(by[(q, d, t)]["params"])
            assert set(merged) == set(ref["params"]) == set(o["full"]), lay
            for k, v in o["full"].items():
                np.testing.assert_array_equal(v, merged[k], err_msg=f"{lay} full_params {k}")
            if t > 0 or d > 0:  # tp and dp peers: bitwise the same dense state
                for k, v in o["params"].items():
                    np.testing.assert_array_equal(v, by[(p, 0, 0)]["params"][k], err_msg=f"{lay} {(p, d, t)} {k}")
        for (p, d, t), o in by.items():  # tied copies bitwise equal after every step
            if not tied_model:
                assert o["tied"] == [None] * len(o["tied"]), lay
                assert "lm_head.weight" in o["optim_keys"] or p == 0, lay
            elif p == 0:
                last = by[(pp - 1, d, t)]
                assert None not in o["tied"] and o["tied"] == last["tied"], (lay, (d, t))
            if tied_model and p in (0, pp - 1):  # the tied weight's optimizer state uses the dense model's key
                assert "transformer.wte.weight" in o["optim_keys"] and "lm_head.weight" not in o["optim_keys"]
            if "ckpt_keys" in o and d == 0:  # checkpoint shares of the dp ranks: disjoint, complete
                shares = [set(by[(p, dd, t)]["ckpt_keys"]) for dd in range(2)]
                assert not shares[0] & shares[1] and shares[0] | shares[1] == set(o["params"]), lay
            if o.get("state", (0,))[0] == 3 and t == 0:  # per-rank model-state bytes = the ZeRO estimator's
                _, measured, n_flats, n_stage = o["state"]  # (fp64: 8 + 8 + 16 bytes per element), up to
                est = model_state_bytes(n_stage, 2, 3, "fp64")["total_bytes"]  # the flat buffers' padding
                assert est <= measured < est + 32 * n_flats, (lay, measured, est)
            if "zero" in o:  # optimizer state really sharded over dp
                z = o["zero"]
                assert z["dp"] == 2 and z["master"] * 2 == z["padded"] and z["exp_avg"] == z["master"], (lay, z)
        if tied_model:
            assert by[(0, 0, 0)]["tied"] != by[(0, 0, 0)]["tied"][:1] * len(by[(0, 0, 0)]["tied"])  # it trains


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def reference(request, data_cache, single_process, tmp_path_factory):
    """The dense run of model family ``request.param`` (GPT-2; Llama with GQA, untied head)."""
    run = str(tmp_path_factory.mktemp("ref3d") / "ref")
    out = _train({"train.micro_batch": 8, "data.cache_dir": data_cache, **parity.MODELS[request.param]}, run)
    out["run"], out["family"] = run, request.param
    assert min(out["norms"]) > BASE["train.grad_clip"]  # clipping active in every step
    return out


def layouts_4(ref_run, family="gpt2"):
    m = parity.MODELS[family]
    return [{**lay, **m} for lay in [
        {**PP2TP2, "parallel.pp_schedule": "1f1b", "train.micro_batch": 2, "name": "pp2tp2"},  # saves
        {**PP2TP2, "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2, "train.micro_batch": 2},
        {**PP2TP2, "parallel.sequence_parallel": "true", "parallel.pp_schedule": "1f1b",  # (b, T/tp, C) hand-offs
         "train.micro_batch": 2},
        {**ZERO, "parallel.dp": 2, "parallel.pp_schedule": "1f1b", "train.micro_batch": 1,
         "parallel.microbatches": 2, "name": "pp2zero"},                                    # 2 flushes; saves
        {**PP2TP2, "parallel.pp_schedule": "1f1b", "train.micro_batch": 4, "resume_from": ref_run},  # dense ->
        {**ZERO, "parallel.dp": 2, "parallel.pp_schedule": "gpipe", "train.micro_batch": 2,
         "resume_from": ref_run},                                                             # dense -> ZeRO
        {**ZERO, "parallel.zero_stage": 3, "parallel.dp": 2, "parallel.pp_schedule": "1f1b",
         "train.micro_batch": 1, "name": "pp2zero3"},                               # pipeline x ZeRO-3; saves
        {**ZERO, "parallel.zero_stage": 2, "parallel.dp": 2, "parallel.pp_schedule": "interleaved",
         "parallel.virtual_stages": 2, "train.micro_batch": 2, "resume_from": ref_run},  # dense -> pp x ZeRO-2
    ]]


@pytest.fixture(scope="module")
def four(reference, data_cache, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("pp4"))
    layouts = layouts_4(reference["run"], reference["family"])
    return {"layouts": layouts, "runs": run_ranks(_many, 4, tmp, data_cache, layouts, join_timeout_s=900),
            "tmp": tmp}


def test_pp2_tp2_and_pp2_dp2_zero1_parity(reference, four):
    _check(reference, four["runs"], four["layouts"])


def test_checkpoints_to_one_process(reference, four, data_cache, tmp_path):
    """pp2 x tp2, pp2 x dp2 ZeRO-1 and pp2 x dp2 ZeRO-3 checkpoints (step SAVE_AT) resumed in one process
    continue exactly like the uninterrupted dense run."""
    for name in ("pp2tp2", "pp2zero", "pp2zero3"):
        dst = str(tmp_path / name)
        _copy_until(f"{four['tmp']}/{name}", dst, SAVE_AT)
        out = _train({"train.micro_batch": 8, "data.cache_dir": data_cache, **parity.MODELS[reference["family"]]},
                     dst, resume=True)
        np.testing.assert_allclose(out["losses"], reference["losses"][SAVE_AT:], rtol=RTOL, err_msg=name)
        _check_params(out["params"], reference["params"], f"{name} -> 1 process")


def layouts_8(ref_run):
    pdt = {**PP2TP2, "parallel.dp": 2}
    return [  # (DDP pp2 x dp2 x tp2 1F1B runs in the covering array: ddp-dp2-tp2sp-pp2-1f1b-acc4)
        {**pdt, "parallel.zero_stage": 1, "parallel.pp_schedule": "1f1b", "train.micro_batch": 1,
         "parallel.sequence_parallel": "true"},                     # SP grad shards summed over tp after the RS
        {**pdt, "parallel.zero_stage": 1, "parallel.pp_schedule": "1f1b", "train.micro_batch": 4,
         "resume_from": ref_run},                                              # dense -> pp x dp x tp ZeRO-1
    ]


def test_pp2_dp2_tp2_eight_processes(reference, data_cache, tmp_path):
    if reference["family"] != "gpt2":
        pytest.skip("8 processes for GPT-2 only (Llama's 3-D layouts run in the parity matrix)")
    layouts = layouts_8(reference["run"])
    runs = run_ranks(_many, 8, str(tmp_path), data_cache, layouts, join_timeout_s=900)
    _check(reference, runs, layouts)


def test_validate_pipeline_combinations():
    from zerotron.config import ConfigError
    from zerotron.plan import build_plan

    def cfg(**kw):
        return tiny_config({"train.global_batch": 8, "train.micro_batch": 2, "parallel.pp": 2, **kw})

    assert build_plan(cfg(**{"parallel.tp": 2}), 4).pp == 2
    assert build_plan(cfg(**{"parallel.tp": 2, "parallel.dp": 2}), 8).tp == 2
    assert build_plan(cfg(**{"parallel.zero_stage": 1}), 4).dp == 2
    assert build_plan(cfg(**{"parallel.zero_stage": 1, "parallel.tp": 2}), 8).dp == 2
    assert build_plan(cfg(**{"parallel.tp": 2, "parallel.sequence_parallel": "true"}), 4).tp == 2  # pp x SP
    assert build_plan(cfg(**{"parallel.zero_stage": 2}), 4).dp == 2  # pipeline x ZeRO-2 / ZeRO-3
    assert build_plan(cfg(**{"parallel.zero_stage": 3, "parallel.tp": 2, "parallel.sequence_parallel": "true"}),
                    8).dp == 2
    for z in (2, 3):  # pipeline x FSDP2 per pipeline rank (pipeline.stage_sync.StageFSDP2), also x tp
        assert build_plan(cfg(**{"parallel.zero_stage": z, "parallel.zero_impl": "fsdp2"}), 4).sync == "fsdp2"
        assert build_plan(cfg(**{"parallel.zero_stage": z, "parallel.zero_impl": "fsdp2", "parallel.tp": 2}),
                          8).sync == "fsdp2"
    for kw, msg in [({"parallel.zero_stage": 1, "parallel.zero_impl": "fsdp2"}, "zero_impl"),
                    ({"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2", "parallel.dp_replicate": 2,
                      "train.micro_batch": 1}, "FSDP2's 2-D HSDP mesh is not split per stage")]:
        with pytest.raises(ConfigError, match=msg):
            build_plan(cfg(**kw), 4)
    assert build_plan(cfg(**{"parallel.dp_impl": "torch"}), 4).sync == "torch_ddp"  # torch DDP per stage chunk
