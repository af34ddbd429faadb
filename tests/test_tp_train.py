"""Tensor (and sequence) parallel training through the real Trainer: parity with one process for
tp 2 and 4 and dp2 x tp2 (DDP and every ZeRO stage over dp), replicated parameters bitwise equal
across tp ranks after every step, checkpoints resharded across tp degrees, TP generation."""
import hashlib
import shutil

import numpy as np
import pytest
import torch

from zerotron.testing import assert_params_close, run_ranks, tiny_config
from zerotron.testing_cli import run_cli

STEPS = 4  # warmup (2 steps), then decay with Adam state (the parity matrix trains 2)
SAVE_AT = 2
BASE = {"train.steps": STEPS, "train.global_batch": 8, "train.eval_every": 0, "checkpoint.save_final": "false",
        "train.grad_clip": 0.1, "train.dtype": "fp64"}
RTOL = 1e-10  # fp64: reassociation noise only, on any CPU


def _train(overrides, run_dir, resume=False):
    from zerotron.parallel.tensor.layers import is_tp_sharded
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({**BASE, **overrides})
    tr = Trainer(cfg, run_dir, resume=resume)
    losses, norms, digests = [], [], []

    def cb(t, rec):
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
        h = hashlib.sha256()
        with t.strategy.full_params() as model:  # ZeRO-3 frees parameters at rest: gather them
            for p in model.parameters():
                if not is_tp_sharded(p) and type(p.data).__name__ != "DTensor":  # replicated ones only
                    h.update(p.detach().double().clone().numpy().tobytes())  # clone: numpy pins storage
        digests.append(h.hexdigest())

    tr.fit(callback=cb)
    with tr.strategy.full_params():
        msd, _ = tr.strategy.state_dict(tr.optimizer)
    return {"losses": losses, "norms": norms, "digests": digests, "coords": tr.mesh.coords,
            "params": {k: v.detach().double().numpy().copy() for k, v in msd.items()}}


def _many(tmp, cache, layouts):
    return [_train({**o, "data.cache_dir": cache}, f"{tmp}/run{i}") for i, o in enumerate(layouts)]


@pytest.fixture(scope="module")
def reference(data_cache, single_process, tmp_path_factory):
    return _train({"train.micro_batch": 8, "data.cache_dir": data_cache}, str(tmp_path_factory.mktemp("tpref")))


def _check(ref, runs, layouts):
    for i, lay in enumerate(layouts):
        out = runs[0][i]
        np.testing.assert_allclose(out["losses"], ref["losses"], rtol=RTOL, err_msg=str(lay))
        np.testing.assert_allclose(out["norms"], ref["norms"], rtol=RTOL, err_msg=str(lay))
        assert_params_close(out["params"], ref["params"], RTOL, str(lay))
        for r in range(1, len(runs)):  # tp-replicated parameters identical across tp ranks
            if runs[r][i]["coords"]["dp"] == out["coords"]["dp"]:
                assert runs[r][i]["digests"] == out["digests"], f"rank {r} replicated params drifted in {lay}"
            assert runs[r][i]["norms"] == out["norms"], (lay, r)


LAYOUTS_2 = [
    {"parallel.tp": 2, "train.micro_batch": 4},
    {"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.micro_batch": 2},
    {"parallel.tp": 2, "parallel.dp_impl": "torch", "train.micro_batch": 8},
    {"parallel.tp": 2, "parallel.dp_impl": "torch", "parallel.sequence_parallel": "true",  # + accumulation 2:
     "train.micro_batch": 4},                                                     # no false unused-parameter refusal
    {"parallel.tp": 2, "train.activation_checkpointing": "selective", "train.micro_batch": 4},
    {"parallel.tp": 2, "parallel.tp_impl": "dtensor", "train.micro_batch": 4},   # torch's TP backend
]
LAYOUTS_4 = [
    {"checkpoint.every": SAVE_AT, "checkpoint.keep": 0, "parallel.tp": 4, "train.micro_batch": 8},  # saves too
    {"parallel.tp": 4, "parallel.sequence_parallel": "true", "train.micro_batch": 4},
    {"parallel.tp": 2, "train.micro_batch": 4},                                         # dp2 x tp2
    {"parallel.tp": 2, "parallel.sequence_parallel": "true", "train.micro_batch": 2},   # dp2 x tp2 + SP
    {"parallel.tp": 2, "parallel.zero_stage": 1, "train.micro_batch": 4},
    {"parallel.tp": 2, "parallel.zero_stage": 2, "parallel.sequence_parallel": "true", "train.micro_batch": 2},
    {"parallel.tp": 2, "parallel.zero_stage": 3, "train.micro_batch": 4},
]


CK = {"checkpoint.every": SAVE_AT, "checkpoint.keep": 0, "train.micro_batch": 8}
SAVE_2 = {**CK, "parallel.tp": 2}  # a parity layout too, whose checkpoints the reshard test resumes
DROPOUT = [{"parallel.tp": 2, "model.dropout": 0.2, "train.micro_batch": 4},
           {"parallel.tp": 2, "model.dropout": 0.2, "parallel.sequence_parallel": "true", "train.micro_batch": 4}]


@pytest.fixture(scope="module")
def two(data_cache, tmp_path_factory):
    """One 2-rank spawn: LAYOUTS_2, SAVE_2 (checkpoints at steps 2 and 4 in ``run{len(LAYOUTS_2)}``),
    then DROPOUT."""
    tmp = tmp_path_factory.mktemp("tp2")
    runs = run_ranks(_many, 2, str(tmp), data_cache, [*LAYOUTS_2, SAVE_2, *DROPOUT])
    return {"tmp": tmp, "runs": runs, "saved": tmp / f"run{len(LAYOUTS_2)}"}


def test_tp2_parity(reference, two):
    n = len(LAYOUTS_2) + 1
    _check(reference, [r[:n] for r in two["runs"]], [*LAYOUTS_2, SAVE_2])


@pytest.fixture(scope="module")
def four(two, data_cache, tmp_path_factory):
    """One 4-process spawn: LAYOUTS_4 (the first saves at steps 2 and 4: it is tp=4 with CK), then the
    tp=2 checkpoint resumed at tp=4, then generation from the tp=2 checkpoint with pp 2 x tp 2 (as
    each ``generate --nproc 4`` worker runs it; the launch itself is test_train_e2e's and test_cli's,
    each layout alone is compared with one process in test_inference)."""
    tmp = tmp_path_factory.mktemp("tp4")
    _copy_until(two["saved"], tmp / "to_tp4", SAVE_AT)
    # sampled at temperature 1 (seeded), not greedy: the 4-step checkpoint's greedy text is newlines
    # whatever the activations between the stages are (zeroed or scaled, they passed); a sample reads
    # the whole distribution
    gen_argv = ["--checkpoint", str(two["saved"]), "--prompt", "ROMEO:", "--max-new-tokens", "16",
                "--temperature", "1.0", "--seed", "3"]
    runs = run_ranks(_four_worker, 4, str(tmp), data_cache, LAYOUTS_4, [(str(tmp / "to_tp4"), {"parallel.tp": 4})],
                     [*gen_argv, "--parallel.pp", "2", "--parallel.tp", "2"], join_timeout_s=900)
    return {"tmp": tmp, "runs": runs, "gen_argv": gen_argv}


def test_tp4_and_dp2_tp2_parity(reference, four):
    _check(reference, [r[0] for r in four["runs"]], LAYOUTS_4)


def test_dropout_replicated_params_stay_equal(two):
    runs = [r[len(LAYOUTS_2) + 1:] for r in two["runs"]]
    for i in range(len(DROPOUT)):
        assert runs[0][i]["digests"] == runs[1][i]["digests"]
        assert runs[0][i]["losses"][-1] < runs[0][i]["losses"][0]


# ---- checkpoints across tp degrees -------------------------------------------------------------


def _copy_until(src, dst, step):
    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if n.startswith("step_") and n != f"step_{step}"])


def _resume(dst, overrides, cache):
    return _train({**CK, **overrides, "data.cache_dir": cache}, dst, resume=True)


def _resume_each(runs, cache):
    """Several resumes in one spawn: [(run dir, overrides), ...] -> their outputs."""
    return [_resume(dst, overrides, cache) for dst, overrides in runs]


def _four_worker(tmp, cache, layouts, runs, generate_argv):
    """The ``four`` fixture's spawn: (:func:`_many` of layouts, :func:`_resume_each` of runs, exit code
    and stdout of ``zerotron generate generate_argv`` run as a launched worker runs it)."""
    import contextlib
    import io

    from zerotron.cli.generate import cmd_generate

    outs = _many(tmp, cache, layouts)
    resumed = _resume_each(runs, cache)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = cmd_generate(generate_argv)
    return outs, resumed, code, text.getvalue()


def test_checkpoint_reshard_across_tp(reference, two, four, data_cache, single_process, tmp_path):
    for dst in ("to_tp1", "to_dtensor"):  # to_dtensor: native TP checkpoint -> torch's DTensor TP
        _copy_until(two["saved"], tmp_path / dst, SAVE_AT)
    _copy_until(four["tmp"] / "run0", tmp_path / "to_tp2", SAVE_AT)  # tp=4 (LAYOUTS_4[0]) saved steps 2 and 4
    (to_tp4,), gen_code, gen_out = four["runs"][0][1:]
    to_tp2, to_dtensor = run_ranks(_resume_each, 2, [(str(tmp_path / "to_tp2"), {"parallel.tp": 2}),
                                                     (str(tmp_path / "to_dtensor"),
                                                      {"parallel.tp": 2, "parallel.tp_impl": "dtensor"})],
                                   data_cache)[0]
    outs = {"tp2 -> tp4": to_tp4,
            "tp4 -> tp2": to_tp2, "tp2 -> dtensor tp2": to_dtensor,
            "tp2 -> tp1": _resume(str(tmp_path / "to_tp1"), {}, data_cache)}
    for name, out in outs.items():
        np.testing.assert_allclose(out["losses"], reference["losses"][SAVE_AT:], rtol=RTOL, err_msg=name)
        assert_params_close(out["params"], reference["params"], RTOL, name)

    # pipelined TP generation (pp 2 x tp 2 from the tp-2 checkpoint) equals single-process seeded
    # sampling through the CLI
    r = run_cli(["generate", *four["gen_argv"]], timeout=300)  # fork-server child
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:") and r.stdout.strip() != "ROMEO:"
    assert gen_code == 0 and gen_out == r.stdout
    assert torch.__version__  # keep torch imported for the spawned helpers


# ---- starting from a Hugging Face GPT-2 checkpoint, sliced per tp rank -------------------------

def _init_from_worker(cache, hf_dir, run_dir):
    return _train({"model.init_from": hf_dir, "parallel.tp": 2, "train.micro_batch": 8, "train.steps": 3,
                   "data.cache_dir": cache}, run_dir)["losses"]


def test_init_from_hf_sliced_per_rank(data_cache, single_process, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotron.data import GlobalBatchSampler, batch_from_indices, num_windows, prepare_data

    cfg = tiny_config({"data.cache_dir": data_cache})
    d = cfg.data
    data = prepare_data(d.corpus, None, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=data.vocab_size, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                    bos_token_id=data.vocab_size - 1, eos_token_id=data.vocab_size - 1)).eval()
    hf.save_pretrained(tmp_path / "hf")
    single = _train({"model.init_from": str(tmp_path / "hf"), "train.micro_batch": 8, "train.steps": 3,
                     "data.cache_dir": data_cache}, str(tmp_path / "single"))["losses"]
    tp2 = run_ranks(_init_from_worker, 2, data_cache, str(tmp_path / "hf"), str(tmp_path / "tp2"))[0]
    np.testing.assert_allclose(tp2, single, rtol=1e-5)
    # independent reference: transformers' own loss on the first global batch
    idx = GlobalBatchSampler(num_windows(len(data.train), 64), 8, cfg.train.seed).global_indices(0)
    x, y = batch_from_indices(data.train, idx, 64)
    with torch.no_grad():
        logits = hf(x).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).item()
    assert abs(single[0] - ref) <= 1e-5 * ref


def test_validate_dtensor_backend():
    """tp_impl = dtensor runs tensor parallelism alone; every other combination is refused by name."""
    from zerotron.config import ConfigError
    from zerotron.plan import build_plan

    def cfg(**kw):
        return tiny_config({"train.global_batch": 8, "train.micro_batch": 2, "parallel.tp": 2,
                            "parallel.tp_impl": "dtensor", **kw})
    assert build_plan(cfg(), 2).tp == 2
    for kw, world in (({}, 4), ({"parallel.pp": 2}, 4), ({"parallel.zero_stage": 1}, 2),
                      ({"parallel.sequence_parallel": "true"}, 2)):
        with pytest.raises(ConfigError, match="tp_impl = dtensor .* runs tensor parallelism alone"):
            build_plan(cfg(**kw), world)
    with pytest.raises(ConfigError, match="needs model.dropout = 0"):
        build_plan(cfg(**{"model.dropout": 0.1}), 2)
    with pytest.raises(ConfigError, match="tp_impl must be native or dtensor"):
        build_plan(cfg(**{"parallel.tp_impl": "megatron"}), 2)
