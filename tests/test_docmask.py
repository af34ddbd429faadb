"""Document masking (``data.doc_mask``, issue 28 deliverable 4): packed windows train exactly like each
document piece run alone (fp64, one process, GPT-2 and Llama); the cp attention implementations
(ring, all-to-all, all-gather) equal dense document-masked attention on their zigzag chunks; the plan's
refusals. The layouts (dp, tp + SP, pp, cp ring / a2a) are trained with doc_mask against one process
in the parity matrix (``zerotron.parity.space.DOC_MASK``, ``tests/test_parity_matrix.py``)."""
import copy
import json

import pytest
import torch

from zerotron.config import ConfigError
from zerotron.plan import build_plan
from zerotron.testing import run_ranks, tiny_config

SEP = 0


def test_document_ids_conventions():
    """The separator ends its document; positions restart after it; a window starting mid-document
    starts a document at position 0."""
    from zerotron.parallel.context.docmask import document_ids

    x = torch.tensor([[5, 6, SEP, 7, SEP, SEP, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8]])
    doc, pos = document_ids(x, SEP)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def _model(arch: str):
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    if arch == "gpt2":
        m = GPT(GPTConfig(vocab_size=32, block_size=24, n_layer=2, n_head=4, n_embd=32))
    else:
        m = Llama(LlamaConfig(vocab_size=32, block_size=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                              intermediate_size=64))
    return m.double()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_equals_each_document_alone(arch):
    """fp64: the packed forward/backward with doc_mask (loss summed over every target, divided by the
    global count) equals running each document piece of each row alone from position 0 (the same
    targets, the same normalisation): loss and every gradient, rtol 1e-10; without the mask it
    differs (the test can fail)."""
    from zerotron.parallel.base import token_loss_sum
    from zerotron.parallel.context.docmask import apply_doc_mask, document_ids

    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, 32, (3, 24), generator=g)
    x[0, [3, 9, 10, 17]] = SEP  # pieces of 4, 6, 1, 7 and 6 tokens (one a lone separator)
    x[1, [0, 23]] = SEP  # a window starting with a separator and ending with one
    y = torch.randint(0, 32, (3, 24), generator=g)
    n = y.numel()
    ref = _model(arch)
    packed = copy.deepcopy(ref)
    hooks = apply_doc_mask(packed, SEP)
    with hooks.documents(x):
        loss = token_loss_sum(packed(x), y) / n
    loss.backward()
    doc, _ = document_ids(x, SEP)
    ref_loss = 0.0
    for b in range(x.size(0)):
        for d in doc[b].unique():
            cols = (doc[b] == d).nonzero().flatten()
            s, e = int(cols[0]), int(cols[-1]) + 1
            piece = token_loss_sum(ref(x[b:b + 1, s:e]), y[b:b + 1, s:e]) / n
            piece.backward()
            ref_loss = ref_loss + piece.detach()
    assert abs(float(loss.detach()) - float(ref_loss)) <= 1e-10 * abs(float(ref_loss))
    worst = 0.0
    for (name, p), (_, q) in zip(packed.named_parameters(), ref.named_parameters()):
        worst = max(worst, float((p.grad - q.grad).norm() / q.grad.norm()))
    assert worst <= 1e-10, worst
    with torch.no_grad():  # the mask matters: plain causal attention over the packed window differs
        plain = token_loss_sum(ref(x), y) / n
    assert abs(float(plain) - float(ref_loss)) > 1e-6
    # generation is a single document: the hooks step aside (no documents needed)
    out = packed.generate(x[:1, :5], 3, temperature=0)
    assert torch.equal(out, ref.generate(x[:1, :5], 3, temperature=0))
    with pytest.raises(RuntimeError, match="outside hooks.documents"):
        packed(x)


def _cp_vs_dense(impls):
    """Every cp rank, each impl: context attention of its zigzag chunks with the documents equals
    dense document-masked attention (values and q/k/v gradients, fp64, GQA 4 on 2)."""
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.parallel.context.attention import context_attention
    from zerotron.parallel.context.docmask import doc_attention, document_ids
    from zerotron.parallel.context.split import split_sequence

    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 32, 8
    q, k, v = (torch.randn(B, h, T, D, dtype=torch.float64) for h in (H, Hkv, Hkv))
    x = torch.randint(1, 9, (B, T))
    x[0, [2, 3, 13, 20, 21, 22]] = SEP  # documents spanning chunk boundaries, one-token documents
    x[1, [7, 8, 30]] = SEP
    doc, _ = document_ids(x, SEP)
    w = torch.randn(B, H, T, D, dtype=torch.float64)
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    dense = doc_attention(qd, kd, vd, doc)
    (dense * w).sum().backward()
    mesh = Mesh(ParallelDims(torch.distributed.get_world_size(), 1, 1, 1, 1, 2), torch.device("cpu"))
    grp, r, cp = mesh.group("cp"), mesh.local_rank("cp"), mesh.size("cp")
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    out = {}
    for impl in impls:
        ql, kl, vl = (split_sequence(t, cp, r, dim=2).requires_grad_() for t in (q, k, v))
        o = context_attention(ql, kl, vl, grp, impl, doc=doc)
        (o * split_sequence(w, cp, r, dim=2)).sum().backward()
        out[impl] = max(rel(o.detach(), split_sequence(dense.detach(), cp, r, dim=2)),
                        rel(ql.grad, split_sequence(qd.grad, cp, r, dim=2)),
                        rel(kl.grad, split_sequence(kd.grad, cp, r, dim=2)),
                        rel(vl.grad, split_sequence(vd.grad, cp, r, dim=2)))
    return out


def test_cp_attention_with_documents_equals_dense(report):
    res = run_ranks(_cp_vs_dense, 2, ("ring", "a2a", "allgather"), timeout_s=60)
    worst = {impl: max(r[impl] for r in res) for impl in res[0]}
    report(f"doc-masked cp attention (cp 2) vs dense, worst relative error: {worst}")
    assert all(e <= 1e-12 for e in worst.values()), worst


def test_refusals(tmp_path):
    tok = tmp_path / "tok.json"
    tok.write_text(json.dumps({"added_tokens": [{"content": "<pad>"}], "model": {"vocab": {"a": 0}}}))
    one = tmp_path / "book.txt"
    one.write_text("one document")
    cases = [({"data.tokenizer": str(tok)}, 1, "no <|endoftext|>"),
             ({"data.corpus": "files", "data.path": str(one)}, 1, "one .txt file"),
             ({"parallel.pp": 2, "parallel.pp_impl": "torch"}, 2, "pp_impl = torch"),
             ({"parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe", "parallel.virtual_stages": 2}, 1, "pp_impl = threads"),
             ({"parallel.tp": 2, "parallel.tp_impl": "dtensor"}, 2, "tp_impl = dtensor")]
    for over, world, needle in cases:
        with pytest.raises(ConfigError) as e:
            build_plan(tiny_config({"data.doc_mask": "true", **over}), world)
        assert needle in str(e.value) and "\n" not in str(e.value) and "data.doc_mask" in str(e.value), str(e.value)
        build_plan(tiny_config({"data.doc_mask": "false", **over}), world) if needle != "no <|endoftext|>" else None


def test_cli_refuses_in_one_line(tmp_path, capsys):
    """``zerotron train`` with doc masking and a tokenizer without a separator: exit 2, one line,
    nothing written."""
    from zerotron.cli.main import main

    tok = tmp_path / "tok.json"
    tok.write_text(json.dumps({"added_tokens": [], "model": {"vocab": {"a": 0}}}))
    run = tmp_path / "run"
    code = main(["train", "--config", "configs/tiny.toml", "--run-dir", str(run), "--data.doc_mask", "true",
                 "--data.tokenizer", str(tok)])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and "data.doc_mask needs a document separator token" in err[0], err
    assert not run.exists()


def test_trainer_masks_documents(tmp_path, single_process):
    """The Trainer installs the masks and its runner passes the documents: one fp64 step with
    validation on the short-document corpus of the parity witnesses (most 16-token windows hold a
    separator), where the masked loss of a micro-batch differs from the plain causal one."""
    from zerotron import parity
    from zerotron.parallel.base import token_loss_sum
    from zerotron.parallel.context.docmask import DocMaskHooks
    from zerotron.train.trainer import Trainer

    docs = {"data.corpus": "files", "data.path": parity.doc_corpus(str(tmp_path / "docs.jsonl"), 1500),
            "data.cache_dir": str(tmp_path / "cache"), "data.doc_mask": "true", "model.n_layer": 1,
            "model.n_embd": 32, "model.block_size": 16, "train.steps": 1, "train.global_batch": 4,
            "train.micro_batch": 2, "train.eval_every": 1, "train.eval_batches": 1, "train.dtype": "fp64",
            "checkpoint.save_final": "false", "log.tensorboard": "false"}
    tr = Trainer(tiny_config(docs), tmp_path / "run")
    hooks = tr.model.parallel_hooks
    assert isinstance(hooks, DocMaskHooks) and tr.strategy.documents == hooks.documents
    x, y = tr.micro_batches(0)[0]
    assert bool((x == tr.data.eot_id).any())
    with torch.no_grad():
        with hooks.documents(x):
            masked = float(token_loss_sum(tr.model(x), y))
        with hooks.generation():  # the hooks step aside: plain causal attention over the window
            plain = float(token_loss_sum(tr.model(x), y))
    assert masked != pytest.approx(plain, rel=1e-9)
    recs = []
    tr.fit(callback=lambda t, rec: recs.append(rec))
    assert len(recs) == 1 and recs[0]["loss"] > 0 and "val_loss" in recs[0]
