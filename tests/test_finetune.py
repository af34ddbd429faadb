"""Fine-tuning real checkpoints (issue 34): tokenizers as they come (a Llama-3-style tokenizer
without <|endoftext|>: its own end token separates documents, generation stops at each of its
end ids, export writes them back and transformers reads the same generation_config)."""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """A Llama-3-style tokenizer directory and a small text corpus (~60k chars of Shakespeare)."""
    from zerotron.data import load_corpus
    from zerotron.data.example import llama3_style_tokenizer

    root = tmp_path_factory.mktemp("llama3")
    text = load_corpus("shakespeare")[0][:60_000]
    (root / "corpus.txt").write_text(text)
    llama3_style_tokenizer([text], 400, root / "tok")
    return root


def _force_next(model, k: int) -> None:
    """Make a Llama (ours or transformers', same module names) predict token ``k`` after every
    token: the blocks add nothing to the residual, the final norm keeps dimension 0 of a positive
    embedding, and only the lm_head row of ``k`` reads it."""
    m = model.model
    with torch.no_grad():
        for layer in m.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.embed_tokens.weight[:, 0] = 1.0
        m.norm.weight.zero_()
        m.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[k, 0] = 1.0


def test_llama3_tokenizer_end_to_end(tmp_path, llama3_dir, single_process):
    """Train on a Llama-3-style tokenizer directory, generate (stops at each eos id, not at
    another token), export (generation_config with both ids), transformers reload stops alike."""
    import copy

    from zerotron.cli import main
    from zerotron.data.tokenizer import EOT, read_special_tokens
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.generate import load_model, stop_ids
    from zerotron.inference import Engine, Request, SamplingParams

    tokdir, run, out = llama3_dir / "tok", tmp_path / "run", tmp_path / "hf"
    sp = read_special_tokens(tokdir)
    assert (sp.eos, sp.eos_id, sp.eos_ids, sp.bos_id) == ("<|end_of_text|>", 1, (1, 4), 0)
    assert sp.chat_template and EOT not in (sp.eos, sp.bos)
    assert main(["train", "--config", "configs/llama_tiny.toml", "--run-dir", str(run), "--train.steps", "1",
                 "--model.n_layer", "2", "--train.eval_every", "0", "--log.progress", "false",
                 "--log.sample_tokens", "0", "--log.plot", "false", "--data.cache_dir", str(tmp_path / "cache"),
                 "--data.corpus", "files", "--data.path", str(llama3_dir / "corpus.txt"),
                 "--data.tokenizer", str(tokdir)]) == 0
    # documents separated by the tokenizer's own end token (one document: one end token at its end)
    from zerotron.data import load_token_data

    cache = next(p for p in (tmp_path / "cache").iterdir() if not p.name.startswith("."))
    td = load_token_data(cache)
    assert td.eot_id == 1 and td.train[-1] == 1 and int((td.train == 1).sum()) == 1
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ckpt / name).is_file(), name
    assert stop_ids(run) == (1, 4)
    model, tok, _ = load_model(run, torch.device("cpu"))
    mesh = Mesh(ParallelDims(1, 0, 1, 1), torch.device("cpu"))
    prompt = tok.encode("ROMEO:").ids
    for k, want in ((4, [4]), (1, [1]), (7, [7] * 5)):  # each end id stops; another token runs to max
        forced = copy.deepcopy(model)
        _force_next(forced, k)
        got = Engine(forced, mesh, eos_id=stop_ids(run)).generate([Request(prompt, SamplingParams(max_tokens=5))])
        assert got[0] == want, (k, got)
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 4] and gen["bos_token_id"] == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|end_of_text|>"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert list(hf.generation_config.eos_token_id) == [1, 4] and hf.generation_config.bos_token_id == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == "<|end_of_text|>" and hf_tok.encode("ROMEO:") == prompt  # bos prepended alike
    x = torch.tensor([prompt])
    for k, want in ((4, [4]), (1, [1])):
        forced = copy.deepcopy(hf)
        _force_next(forced, k)
        with torch.no_grad():
            got = forced.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=1)[0, x.size(1):].tolist()
        assert got == want, (k, got)


CHAT = "configs/chat_example.jsonl"


def _word_tokenizer(words):
    """A WordLevel tokenizer (one token per whitespace-separated word) with Llama 3's specials,
    so target counts can be done by hand."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from zerotron.data.example import SPECIALS

    vocab = {w: i for i, w in enumerate([*SPECIALS, "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(SPECIALS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_masked_targets_equal_a_hand_count():
    """The assistant spans of a chat row (found by rendering message prefixes) and of a
    prompt/completion row, counted by hand on a word-level tokenizer; truncation and dropping
    follow the stated rule; bad rows and a failing template are one-line DataErrors."""
    from zerotron.data import DataError
    from zerotron.data.sft import build_windows
    from zerotron.data.tokenizer import SpecialTokens

    words = "system user assistant be brief hi there hello friend a b c d e f g why so".split()
    tok = _word_tokenizer(words)
    sp = SpecialTokens(eos="<|end_of_text|>", eos_id=1, eos_ids=(1, 4), bos="<|begin_of_text|>", bos_id=0)
    # header, role, end header, content words, end of turn -- spaces between, as words
    tmpl = ("{{ bos_token }}{% for m in messages %} <|start_header_id|> {{ m['role'] }} <|end_header_id|> "
            "{{ m['content'] }} <|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %} <|start_header_id|> assistant <|end_header_id|> {% endif %}")
    m = lambda r, c: {"role": r, "content": c}  # noqa: E731
    rows = [("r1", {"messages": [m("system", "be brief"), m("user", "hi there"), m("assistant", "hello friend")]}),
            ("r2", {"messages": [m("user", "a b"), m("assistant", "c"), m("user", "d"), m("assistant", "e f g")]})]
    # by hand: r1 trains "hello friend <|eot_id|>" = 3; r2 "c <|eot_id|>" + "e f g <|eot_id|>" = 2 + 4
    ids, mask, counts = build_windows(tok, rows, "chat", sp, 40, tmpl)
    assert counts == {"rows": 2, "truncated_rows": 0, "dropped_rows": 0, "target_tokens": 9}
    assert ids.size == 2 * 40 + 1 and int(mask.sum()) == 9
    trained = [tok.id_to_token(int(t)) for t, k in zip(ids, mask) if k]
    assert trained == ["hello", "friend", "<|eot_id|>", "c", "<|eot_id|>", "e", "f", "g", "<|eot_id|>"]
    # a turn is header, role, end header, its words, end of turn: r1 = bos + 6 + 6 + 6 = 19 tokens,
    # r2 = bos + 6 (user a b) + 5 (assistant c) + 5 (user d) + 7 (assistant e f g) = 24. At S = 20 r1 is
    # whole, r2 keeps its first 20 (the last answer's header only): 3 + 2 targets
    _, _, c20 = build_windows(tok, rows, "chat", sp, 20, tmpl)
    assert c20 == {"rows": 2, "truncated_rows": 1, "dropped_rows": 0, "target_tokens": 3 + 2}
    # S = 12: r1 keeps bos, its system turn and the user turn (no target: dropped), r2 keeps "c <|eot_id|>"
    _, _, c12 = build_windows(tok, rows, "chat", sp, 12, tmpl)
    assert c12 == {"rows": 1, "truncated_rows": 2, "dropped_rows": 1, "target_tokens": 2}
    # prompt/completion: bos + prompt masked, completion + eos trained: "why so" + eos = 3
    _, _, pc = build_windows(tok, [("p", {"prompt": "a b", "completion": "why so"})], "prompt_completion", sp, 8, None)
    assert pc["target_tokens"] == 3
    bad = [("no assistant", [("x:1", {"messages": [m("user", "hi")]})], tmpl, "no assistant turn"),
           ("template raises", rows, "{{ raise_exception('only user turns') }}", "failed to render"),
           ("template syntax", rows, "{% for %}", "does not compile"),
           ("not a prefix", rows, "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            "prefixes")]
    for what, rs, t, msg in bad:
        with pytest.raises(DataError, match=msg) as e:
            build_windows(tok, rs, "chat", sp, 40, t)
        assert "\n" not in str(e.value), what


def _sft_extra(tmp_path, tokdir):
    """The parity matrix's model with 64-token windows (each chat row fits) and 4 layers."""
    return {"data.corpus": "files", "data.path": CHAT, "data.format": "chat", "data.tokenizer": str(tokdir),
            "data.cache_dir": str(tmp_path / "cache"), "model.block_size": 64, "model.n_layer": 4}


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A Llama-3-style tokenizer trained on the shipped chat rows."""
    from zerotron.data.dataset import _row_texts
    from zerotron.data.example import llama3_style_tokenizer
    from zerotron.data.sft import read_rows

    out = tmp_path_factory.mktemp("chat_tok")
    return llama3_style_tokenizer([t for _, r in read_rows(CHAT) for t in _row_texts(r)], 1000, out)


# the default suite runs two representative layouts (dp with ZeRO-3 sharding, tp with sequence
# parallelism); ZEROTRON_SFT_FULL=1 adds plain dp2 and pp2 (make test-finetune)
SFT_LAYOUTS = ("zero3-dp2-acc4", "ddp-dp1-tp2sp-acc4") + (
    ("ddp-dp2-acc4", "ddp-dp1-pp2-1f1b-acc4") if os.environ.get("ZEROTRON_SFT_FULL") else ())


def test_sft_parity_fp64(tmp_path, chat_tokenizer, single_process, report):
    """Masked-loss (chat) training in fp64 over dp2, ZeRO-3 dp2, tp2+SP and pp2 equals one process
    (rtol 1e-10): the loss is normalised by the global count of unmasked targets."""
    from zerotron import parity
    from zerotron.testing import run_ranks

    extra = _sft_extra(tmp_path, chat_tokenizer)
    ref = parity.reference(str(tmp_path / "ref"), extra)
    ref_path = str(tmp_path / "ref.pt")
    torch.save(ref, ref_path)
    lays = [lay.as_dict() for lay in parity.all_layouts() if lay.name in SFT_LAYOUTS]
    assert len(lays) == len(SFT_LAYOUTS)
    per_rank = run_ranks(parity.run_many, 2, lays, ref_path, str(tmp_path / "w2"), extra, timeout_s=120)
    worst = {}
    for i, d in enumerate(lays):
        recs = [per_rank[r][i] for r in range(2)]
        s = parity.check(d["name"], recs, (set(ref["params"]), set(ref["optim"])), parity.FP64_RTOL)
        worst[d["name"]] = max(s[k] for k in parity.ERRORS)
    report("SFT parity fp64 (chat, masked loss), worst relative error: "
           + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))
