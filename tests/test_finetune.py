"""Fine-tuning real checkpoints (issue 34): tokenizers as they come (a Llama-3-style tokenizer
without <|endoftext|>: its own end token separates documents, generation stops at each of its
end ids, export writes them back and transformers reads the same generation_config)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from zerotron.data.example import word_level_tokenizer

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


def _llama3_args(root, cache) -> list[str]:
    return ["--config", "configs/llama_tiny.toml", "--train.steps", "1", "--model.n_layer", "2",
            "--train.eval_every", "0", "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false",
            "--data.cache_dir", str(cache), "--data.corpus", "files", "--data.path", str(root / "corpus.txt"),
            "--data.tokenizer", str(root / "tok")]


@pytest.fixture(scope="module")
def llama3_run(llama3_dir):
    """A run (1 step, full fine-tuning) of a 2-layer Llama on the Llama-3-style tokenizer."""
    from zerotron.cli import main

    run = llama3_dir / "run"
    assert main(["train", *_llama3_args(llama3_dir, llama3_dir / "cache"), "--run-dir", str(run)]) == 0
    return run


def test_llama3_tokenizer_end_to_end(tmp_path, llama3_dir, llama3_run, single_process):
    """Train on a Llama-3-style tokenizer directory, generate (stops at each eos id, not at
    another token), export (generation_config with both ids), transformers reload stops alike."""
    import copy

    from zerotron.cli import main
    from zerotron.data.tokenizer import EOT, read_special_tokens
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.generate import load_model, stop_ids
    from zerotron.inference import Engine, Request, SamplingParams

    tokdir, run, out = llama3_dir / "tok", llama3_run, tmp_path / "hf"
    sp = read_special_tokens(tokdir)
    assert (sp.eos, sp.eos_id, sp.eos_ids, sp.bos_id) == ("<|end_of_text|>", 1, (1, 4), 0)
    assert sp.chat_template and EOT not in (sp.eos, sp.bos)
    # documents separated by the tokenizer's own end token (one document: one end token at its end)
    from zerotron.data import load_token_data

    cache = next(p for p in (llama3_dir / "cache").iterdir() if not p.name.startswith("."))
    td = load_token_data(cache)
    assert td.eot_id == 1 and td.train[-1] == 1 and int((td.train == 1).sum()) == 1
    ckpt = sorted((run / "checkpoints").iterdir())[-1]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ckpt / name).is_file(), name
    assert stop_ids(run) == (1, 4)
    from zerotron.serve.chat import ChatTemplate, load_chat_template  # what serve renders chat requests with

    prompt_text = ChatTemplate(load_chat_template(ckpt), sp.eos).render([{"role": "user", "content": "Hi"}])
    assert prompt_text == "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>" \
                          "<|start_header_id|>assistant<|end_header_id|>\n\n"  # (bos: the post-processor adds it)
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


def test_masked_targets_equal_a_hand_count():
    """The assistant spans of a chat row (found by rendering message prefixes) and of a
    prompt/completion row, counted by hand on a word-level tokenizer; truncation and dropping
    follow the stated rule; bad rows and a failing template are one-line DataErrors."""
    from zerotron.data import DataError
    from zerotron.data.sft import build_windows
    from zerotron.data.tokenizer import SpecialTokens

    words = "system user assistant be brief hi there hello friend a b c d e f g why so".split()
    tok = word_level_tokenizer(words)
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
            "prefixes"),
           # was "raise model.block_size or shorten the rows", for rows of a few tokens
           ("no assistant text", rows, "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}"
            "{% endif %}{% endfor %}", "the chat template renders none of the assistant turns' text")]
    for what, rs, t, msg in bad:
        with pytest.raises(DataError, match=msg) as e:
            build_windows(tok, rs, "chat", sp, 40, t)
        assert "\n" not in str(e.value), what


def _sft_extra(tmp_path, tokdir):
    """The parity matrix's model with 64-token windows (each chat row fits) and 4 layers."""
    return {"data.corpus": "files", "data.path": CHAT, "data.format": "chat", "data.tokenizer": str(tokdir),
            "data.cache_dir": str(tmp_path / "cache"), "model.block_size": 64, "model.n_layer": 4}


# the default suite runs one representative layout (tp with sequence parallelism: the vocab-parallel
# loss skips masked targets); ZEROTRON_SFT_FULL=1 adds dp2, ZeRO-3 dp2 and pp2 (make test-finetune)
SFT_LAYOUTS = ("ddp-dp1-tp2sp-acc4",) + (
    ("ddp-dp2-acc4", "zero3-dp2-acc4", "ddp-dp1-pp2-1f1b-acc4") if os.environ.get("ZEROTRON_SFT_FULL") else ())


def test_sft_parity_fp64(tmp_path, chat_tokenizer, single_process, report):
    """Masked-loss (chat) training in fp64 over dp2, ZeRO-3 dp2, tp2+SP and pp2 equals one process
    (rtol 1e-10): the loss is normalised by the global count of unmasked targets."""
    from zerotron import parity

    extra = _sft_extra(tmp_path, chat_tokenizer)
    ref = parity.reference(str(tmp_path / "ref"), extra)
    lays = [lay.as_dict() for lay in parity.all_layouts() if lay.name in SFT_LAYOUTS]
    assert len(lays) == len(SFT_LAYOUTS)
    worst = parity.parity_worst(lays, ref, tmp_path, extra)
    report("SFT parity fp64 (chat, masked loss), worst relative error: "
           + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))


def test_lora_targets_are_the_layouts_projections():
    """PROJECTIONS (plain data the plan checks) names exactly each family's block Linear layers;
    target names resolve by full path or last part; unknown ones and unsupported layouts are
    refused by the plan in one line."""
    from zerotron.config import ConfigError, model_shape
    from zerotron.models import registry
    from zerotron.models.layout import PROJECTIONS, get_module, lora_targets, projection_widths
    from zerotron.plan import build_plan
    from zerotron.testing import tiny_config

    for arch, preset in (("gpt2", "tiny"), ("llama", "llama-tiny")):
        section = tiny_config({"model.arch": arch, "model.preset": preset}).model
        model = registry.build_model(registry.config_from_section(section, 300))
        assert set(model.layout().block_tp) == set(PROJECTIONS[arch]), arch
        block = get_module(model, model.layout().blocks)[0]  # the widths the plan's rank check uses are real
        assert projection_widths(arch, model_shape(section)) == {
            p: (get_module(block, p).in_features, get_module(block, p).out_features) for p in PROJECTIONS[arch]}
    assert lora_targets("llama", "") == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    assert lora_targets("gpt2", "c_proj") == ("attn.c_proj", "mlp.c_proj")
    lora = {"train.lora_rank": 4}
    build_plan(tiny_config({**lora, "parallel.pp": 2, "parallel.dp": 1}), 2)  # a pipeline over dp runs
    for ok in ({"parallel.zero_stage": 3}, {"parallel.zero_stage": 2, "parallel.zero_impl": "fsdp2"},
               {"parallel.tp": 2, "parallel.sequence_parallel": "true", "parallel.dp": 1}):
        build_plan(tiny_config({**lora, **ok}), 2)  # ZeRO, FSDP2, tensor parallelism run
    for extra, world, msg in (({"train.lora_targets": "q_proj"}, 1, "does not have"),
                              ({"parallel.tp": 2, "parallel.tp_impl": "dtensor"}, 2, "tp_impl = native"),
                              ({"parallel.cp": 2}, 2, "parallel.cp = 1"),
                              ({"train.lora_dropout": 1.0}, 1, "lora_dropout"),
                              ({"train.lora_rank": 65}, 1, r"min\(in, out\) = min\(64, 192\) = 64")):
        with pytest.raises(ConfigError, match=msg) as e:
            build_plan(tiny_config({**lora, **extra}), world)
        assert "\n" not in str(e.value)


LORA = {"train.lora_rank": 4, "train.lora_targets": "q_proj,v_proj,down_proj", "train.lr": 0.05}
LORA_LAYOUTS = ("ddp-dp2-acc4",) + (("ddp-dp1-pp2-1f1b-acc4",) if os.environ.get("ZEROTRON_SFT_FULL") else ())


def test_lora_parity_fp64_and_frozen_base(tmp_path, data_cache, single_process, report):
    """LoRA (rank 4 on q, v and down projections of the matrix's Llama) in fp64: dp2 (and pp2 under
    ZEROTRON_SFT_FULL=1) equal one process (rtol 1e-10); the base weights are bitwise unchanged,
    the adapters moved, and the per-step gradient / optimizer bytes are those of the adapters only."""
    from zerotron import parity
    from zerotron.models import registry
    from zerotron.parity.space import MODELS, Layout, config_for
    from zerotron.train.setup import gpt_config

    extra = {"data.cache_dir": data_cache, **MODELS["llama"], **LORA}
    ref = parity.reference(str(tmp_path / "ref"), extra)
    cfg = config_for(Layout("ddp", 1, 1, False, 1, None, 1), extra)
    torch.manual_seed(cfg.train.seed)  # the initial weights, as the Trainer builds them
    init = registry.build_model(gpt_config(cfg, ref["params"]["model.embed_tokens.weight"].shape[0]))
    init = {k: v.double() for k, v in init.state_dict().items()}
    adapters = [k for k in ref["params"] if "lora_" in k]
    assert len(adapters) == 2 * 3 * 8 and set(ref["params"]) - set(adapters) == set(init)
    assert all(torch.equal(init[k], ref["params"][k]) for k in init)  # bitwise unchanged
    assert all(ref["params"][k].abs().max() > 0 for k in adapters if k.endswith("lora_B"))  # trained from 0
    assert set(ref["optim"]) == set(adapters)  # optimizer state: adapters only
    n_adapter = sum(ref["params"][k].numel() for k in adapters)
    rec = [json.loads(line) for line in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    states = [r["model_state_breakdown"] for r in rec if "model_state_breakdown" in r][-1]
    assert states["grads_bytes"] == 8 * n_adapter and states["optimizer_bytes"] == 2 * 8 * n_adapter  # fp64, Adam
    assert states["params_bytes"] == 8 * sum(v.numel() for v in ref["params"].values())
    from zerotron.analysis.memory import model_state_bytes

    est = model_state_bytes(sum(v.numel() for v in ref["params"].values()), 1, 0, "fp64", trainable=n_adapter)
    assert {k: est[k] for k in states} == states  # the estimator counts the frozen and trainable parts
    lays = [lay.as_dict() for lay in parity.all_layouts() if lay.name in LORA_LAYOUTS]
    worst = parity.parity_worst(lays, ref, tmp_path, extra)
    report("LoRA parity fp64 (rank 4), worst relative error: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))


def test_lora_export_merged_and_peft_adapter(tmp_path, llama3_dir, llama3_run, report):
    """A LoRA run on a Llama with a Llama-3-style tokenizer (fp64 training) resumes equal to an
    uninterrupted run; export merged, and --adapter (base + peft adapter directory): peft's logits
    on the exported base equal zerotron's (fp32) and the merged export's; an adapter export of a run
    without LoRA and an unknown LoRA target are one line, exit 2."""
    peft = pytest.importorskip("peft")
    from zerotron.cli import main
    from zerotron.generate import load_model
    from zerotron.testing_cli import run_cli

    common = _llama3_args(llama3_dir, llama3_dir / "cache")
    run, half = tmp_path / "run", tmp_path / "half"
    lora = ["--train.lora_rank", "4", "--train.lr", "0.05", "--train.dtype", "fp64"]
    assert main(["train", *common, "--run-dir", str(run), *lora, "--train.steps", "2"]) == 0
    assert main(["train", *common, "--run-dir", str(half), *lora, "--train.steps", "1"]) == 0
    assert main(["train", *common, "--run-dir", str(half), *lora, "--train.steps", "2", "--resume"]) == 0
    losses = [[json.loads(line)["loss"] for line in (r / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
              for r in (run, half)]
    assert losses[0] == losses[1] and len(losses[0]) == 2  # a resumed LoRA run equals an uninterrupted one
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "base"),
                 "--adapter", str(tmp_path / "adapter")]) == 0
    ours, tok, _ = load_model(run, torch.device("cpu"), merge=False)
    ours.float()
    x = torch.tensor([tok.encode("ROMEO: what light through yonder window breaks").ids])
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        want = ours(x)
        want = want[0] if isinstance(want, tuple) else want
        got = peft_model(x).logits
        got_merged = merged(x).logits
    d_peft, d_merged = (got - want).abs().max().item(), (got_merged - want).abs().max().item()
    assert d_peft < 1e-4 and d_merged < 1e-4, (d_peft, d_merged)
    with torch.no_grad():
        plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()(x).logits
    assert (plain - want).abs().max().item() > 1e-3  # the adapters change the model (the test can fail)
    report(f"LoRA export: peft-loaded adapter vs zerotron logits max abs diff {d_peft:.2e} (fp32), "
           f"merged export {d_merged:.2e}")
    r = run_cli(["export", "--checkpoint", str(llama3_run), "--out", str(tmp_path / "x"), "--adapter", str(tmp_path / "y")])
    assert r.returncode == 2 and "no LoRA adapters" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = run_cli(["train", *common, "--run-dir", str(tmp_path / "bad"), "--train.lora_rank", "4",
                 "--train.lora_targets", "c_attn"])
    assert r.returncode == 2 and "does not have" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _lora_state_bytes(cache: str, tmp: str, syncs: list[str]) -> list[dict]:
    """Rank body: train the matrix's Llama with LoRA one step under each dp-2 ``sync`` and return
    the strategy's measured model-state bytes with the estimator's for the same counts."""
    from zerotron.analysis.memory import model_state_bytes
    from zerotron.parity.space import MODELS, Layout, config_for
    from zerotron.train.trainer import Trainer

    out = []
    for sync in syncs:
        lay = Layout(sync, 2, 1, False, 1, None, 1, lora=True)
        tr = Trainer(config_for(lay, {"data.cache_dir": cache, **MODELS["llama"], "train.steps": 1}), f"{tmp}/{lay.name}")
        tr.fit()
        msd, _ = tr.strategy.state_dict(tr.optimizer)
        n_all = sum(v.numel() for v in msd.values())
        n_train = sum(v.numel() for k, v in msd.items() if ".lora_" in k)
        stage = int(sync[-1]) if sync.startswith(("zero", "fsdp2")) else 0
        meas = tr.strategy.model_state_bytes(tr.optimizer)
        est = model_state_bytes(n_all, 2, stage, "fp64", trainable=n_train)
        out.append({"sync": sync, "measured": {k: meas[k] for k in est}, "estimated": est, "n_train": n_train,
                    "n_all": n_all})
    return out


def test_lora_zero_state_bytes_equal_the_estimator(tmp_path, data_cache, report):
    """LoRA under native ZeRO-3 (and ZeRO-1, FSDP2 stage 3 under ZEROTRON_SFT_FULL=1) over dp 2 (fp64): per rank, the bytes the flat buffers
    hold for parameters (frozen base too), gradients and optimizer state (adapters only) equal the
    memory estimator's ``trainable`` formula (every flat buffer's size is even here, so the
    per-buffer padding is zero; FSDP2 pads each parameter's dim 0, also zero here)."""
    from zerotron.testing import run_ranks

    syncs = ["zero3"] + (["zero1", "fsdp2_3"] if os.environ.get("ZEROTRON_SFT_FULL") else [])
    per_rank = run_ranks(_lora_state_bytes, 2, data_cache, str(tmp_path), syncs, timeout_s=120)
    lines = []
    for i, sync in enumerate(syncs):
        for r in range(2):
            rec = per_rank[r][i]
            assert rec["measured"] == rec["estimated"], (sync, r, rec)
            assert rec["measured"]["grads_bytes"] <= 8 * rec["n_train"]  # no frozen gradient anywhere
        m, e = per_rank[0][i]["measured"], per_rank[0][i]["estimated"]
        lines.append(f"{sync}: params {m['params_bytes']}/{e['params_bytes']}, grads {m['grads_bytes']}/"
                     f"{e['grads_bytes']}, optimizer {m['optimizer_bytes']}/{e['optimizer_bytes']}")
    report("LoRA model-state bytes per rank, measured/estimated (dp 2, fp64, "
           f"{per_rank[0][0]['n_train']} of {per_rank[0][0]['n_all']} parameters trained): " + "; ".join(lines))
