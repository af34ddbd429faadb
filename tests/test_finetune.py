"""Fine-tuning real checkpoints (issue 34): tokenizers as they come (a Llama-3-style tokenizer
without <|endoftext|>: its own end token separates documents, generation stops at each of its
end ids, export writes them back and transformers reads the same generation_config)."""
from __future__ import annotations

import json

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
