"""Evaluation over validation windows that do not split evenly over dp ranks: every layout runs the
same number of forwards per dp rank (ZeRO-3 and FSDP2 all-gather parameters in each one) and
evaluates exactly the windows of one process, once each, with the same loss."""
import numpy as np
import pytest

from zerotron.testing import run_ranks, tiny_config

# evaluated in this order: before the fix the stage-3 layouts deadlocked (first one times out)
LAYOUTS = {"zero3": {"parallel.zero_stage": 3},
           "fsdp2": {"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"},
           "dp": {}}


def test_val_rank_windows_split():
    from zerotron.train.setup import val_rank_windows

    for n, dp, mb in [(7, 2, 1), (7, 2, 2), (9, 4, 2), (3, 4, 1), (10, 3, 4), (8, 2, 2)]:
        idx = np.arange(n, dtype=np.int64) * 3 + 1
        per = [val_rank_windows(idx, r, dp, mb) for r in range(dp)]
        assert len({len(p) for p in per}) == 1, (n, dp, mb, per)  # same number of forwards
        assert len(per[0]) == -(-(-(-n // dp)) // mb)
        for p in per:  # at most micro_batch windows each; padding (empty) slots only at the end
            sizes = [len(g) for g in p]
            assert max(sizes) <= mb and sizes == sorted(sizes, reverse=True), sizes
        got = np.concatenate([g for p in per for g in p])
        assert got.tolist() == idx.tolist(), (n, dp, mb)  # disjoint, complete, in order
    with pytest.raises(ValueError, match="dp_rank"):
        val_rank_windows(np.arange(4), 2, 2, 1)


def _overrides(tmp, corpus, block_size, n_val):
    return {"data.corpus": "files", "data.path": corpus, "data.cache_dir": tmp / "cache",
            "model.block_size": block_size, "model.n_layer": 2, "train.micro_batch": 1,
            "train.global_batch": 2, "train.eval_batches": n_val, "parallel.timeout_s": 30}


def _evaluate(overrides, layouts, run_dir):
    """Per layout: (val loss, this rank's windows, number of eval batches) from a fresh Trainer."""
    from zerotron.train.step import evaluate
    from zerotron.train.trainer import Trainer

    out, trainers = {}, {}
    for name, extra in layouts.items():
        tr = Trainer(tiny_config({**overrides, **extra}), run_dir)
        trainers[name] = tr
        out[name] = {"loss": evaluate(tr.strategy, tr.val_batches, tr.cfg.train.dtype, tr.device),
                     "n_batches": len(tr.val_batches)}
    for name, tr in trainers.items():  # read after every evaluation ran
        out[name]["windows"] = tr.val_windows.tolist()
    return out


def test_eval_clip_note():
    """More validation than the split holds is clipped to the whole split (never wrapped), and said."""
    from zerotron.data import GlobalBatchSampler
    from zerotron.train.setup import eval_clip_note

    assert eval_clip_note(2062, 2, 8, 64) is None and eval_clip_note(16, 2, 8, 64) is None
    assert GlobalBatchSampler.val_indices(2062, 10**9 * 8).tolist() == list(range(2062))  # each window once
    assert eval_clip_note(2062, 10**9, 8, 64) == (
        "zerotron: note: train.eval_batches 1,000,000,000 x train.global_batch 8 asks for 8,000,000,000 validation "
        "windows, more than the split holds (2,062 windows of 64 tokens): each evaluation reads all of them once, "
        "258 global batches; lower train.eval_batches to evaluate less")


def test_uneven_val_split_matches_one_process(tmp_path, single_process, capsys):
    from zerotron.data import load_corpus, num_windows, prepare_data

    text = load_corpus("shakespeare")[0][:40_000]
    corpus = tmp_path / "small.txt"
    corpus.write_text(text)
    d = tiny_config({"data.corpus": "files", "data.path": corpus, "data.cache_dir": tmp_path / "cache"}).data
    val = prepare_data(d.corpus, d.path, d.text_field, d.vocab_size, d.val_fraction, d.cache_dir).val
    # a sequence length whose number of validation windows is odd: dp 2 cannot split it evenly
    block_size, n_val = next((b, num_windows(len(val), b)) for b in range(32, 128)
                             if num_windows(len(val), b) % 2 and num_windows(len(val), b) >= 5)
    ov = _overrides(tmp_path, corpus, block_size, n_val)
    ref = _evaluate(ov, {"one": {}}, tmp_path / "ref")["one"]
    # eval_batches n_val x global_batch 2: twice the split, clipped to it, and said in one line (was silent)
    assert f"asks for {2 * n_val:,} validation windows, more than the split holds ({n_val:,} windows of " \
        f"{block_size} tokens)" in capsys.readouterr().err
    assert ref["windows"] == list(range(n_val)) and ref["n_batches"] == n_val
    ranks = run_ranks(_evaluate, 2, ov, LAYOUTS, tmp_path / "dp2", timeout_s=30, join_timeout_s=300)
    for name in LAYOUTS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert len(r0["windows"]) == len(r1["windows"]) + 1, name  # the uneven case
        assert not set(r0["windows"]) & set(r1["windows"]), name
        assert r0["windows"] + r1["windows"] == ref["windows"], name  # complete, once each
        assert r0["n_batches"] == r1["n_batches"] == len(r0["windows"]), name
        assert r0["loss"] == r1["loss"] == ref["loss"], (name, r0["loss"], r1["loss"], ref["loss"])
