"""The paged engine's compiled decode step (``ContinuousDecoder(compile=True)``, ``serve --compile``;
``zerotron.inference.paged_compiled``): its attention over the pool read through the slot indices
equals the models' causal attention (fp64, eager), and greedy tokens of the compiled decoder equal
the eager decoder's while rows join, leave (down to one row) and the contexts grow, with one graph
compiled once (dynamic shapes: no recompile after the warm-up).

Inductor compiles C++ on this CPU (several minutes for this graph on 2 loaded cores, 309 s measured
at load 14): the default suite traces the same graph with the ``aot_eager`` backend (Dynamo's capture,
dynamic shapes, the decoder's padding and writes; no C++), ``ZEROTRON_COMPILE=full``
(``make test-compile``) compiles it with Inductor, for GPT-2 tiny and Llama tiny (grouped-query
heads, RoPE), fp64. Greedy and seeded sampled rows (fp64: equal logits up to rounding draw equal tokens)."""
import os

import pytest
import torch

from zerotron.inference.batch import Request
from zerotron.inference.sampling import SamplingParams
from zerotron.models import registry
from zerotron.models.base import causal_attention

FULL = os.environ.get("ZEROTRON_COMPILE", "") == "full"
VOCAB = 97


def test_paged_decode_attention_equals_causal_attention():
    """One query per row over its cached slots read in place through its block table, plus its own
    new key, grouped-query heads (4 query heads on 2 kv heads): equals ``causal_attention`` over the
    left-padded gathered keys (fp64, 1e-12), and a wrong length (a slot past the row's) is caught."""
    from zerotron.inference.paged_compiled import paged_decode_attention

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, page, nblocks = 5, 4, 2, 8, 4, 12
    keys = torch.randn(Hkv, nblocks * page, D, generator=g, dtype=torch.float64)
    values = torch.randn(Hkv, nblocks * page, D, generator=g, dtype=torch.float64)
    lens = [0, 3, 9, 4, 6]  # row 0: only its own new key; blocks shared and out of order
    tables = [[5], [2], [7, 1, 3], [4, 0], [2, 9]]
    W = max(len(t) for t in tables)
    table = torch.tensor([t + [11] * (W - len(t)) for t in tables])
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    kn = torch.randn(B, Hkv, 1, D, generator=g, dtype=torch.float64)
    vn = torch.randn(B, Hkv, 1, D, generator=g, dtype=torch.float64)
    S = max(lens) + 1
    pad = torch.tensor([S - 1 - n for n in lens])
    slots = [[t[j // page] * page + j % page for j in range(n)] for t, n in zip(tables, lens)]
    idx = torch.tensor([[0] * (S - 1 - n) + s for s, n in zip(slots, lens)])  # left padding reads slot 0, masked
    k = torch.cat([keys[:, idx].transpose(0, 1), kn], dim=2)  # (B, Hkv, S, D)
    v = torch.cat([values[:, idx].transpose(0, 1), vn], dim=2)
    want = causal_attention(q, k, v, 0.0, pad)
    got = paged_decode_attention(q, kn, vn, keys, values, table, torch.tensor(lens), page)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-12
    longer = torch.tensor(lens) + torch.tensor([0, 1, 0, 0, 0])  # row 1 reads one slot too many
    assert (paged_decode_attention(q, kn, vn, keys, values, table, longer, page) - want).abs().max() > 1e-3


def _decode(model, compile_: bool, schedule):
    """Tokens per row id of a ContinuousDecoder over ``schedule``: {step: [(row, prompt, max_tokens)]}; even
    rows greedy, odd rows sampled (temperature 1, seeded by the row: a tiny random model's argmax hardly
    depends on the context, a sample depends on every logit)."""
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.inference.continuous import ContinuousDecoder
    from zerotron.inference.engine import Engine

    eng = Engine(model, Mesh(ParallelDims(1), torch.device("cpu")))
    dec = ContinuousDecoder(eng, num_blocks=64, page=4, compile=compile_)
    out, step, rows = {}, 0, set()
    while step in schedule or dec.running:
        joins = [(rid, 0, Request(p, SamplingParams(max_tokens=m, stop_at_eos=False, temperature=float(rid % 2),
                                                    seed=rid)))
                 for rid, p, m in schedule.get(step, [])]
        rows |= {j[0] for j in joins}
        res = dec.step(joins, [])
        out.update(res.finished)
        step += 1
    assert set(out) == rows
    return out, dec


def _check(preset, backend, tmp_path, monkeypatch):
    from zerotron.inference import paged_compiled
    from zerotron.parallel.compile import compile_stats

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(paged_compiled, "BACKEND", backend)
    torch.manual_seed(0)  # few layers: the compile time grows with the graph (1 traced, 2 under Inductor)
    layers = 1 if backend == "aot_eager" else 2
    model = registry.build_model(registry.preset_config(preset, vocab_size=VOCAB, block_size=48, n_layer=layers))
    model = model.to(torch.float64).eval()
    g = torch.Generator().manual_seed(1)

    def prompt(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    # rows join at steps 0, 3 and 7 and leave at different steps (the batch goes 3 -> 4 -> ... -> 1);
    # row 5's context (30 + 24) passes block_size 48: recomputed from its last 48 tokens, then compiled again
    schedule = {0: [(0, prompt(5), 9), (1, prompt(1), 14), (2, prompt(12), 4)],
                3: [(3, prompt(7), 20), (4, prompt(2), 3)], 7: [(5, prompt(30), 24)]}
    def grown(before):  # this test's compiles (the counters are the process's: other tests may compile too)
        now = compile_stats()
        return {k: now[k] - before[k] for k in ("graphs", "recompiles", "graph_breaks")}

    want, _ = _decode(model, False, schedule)
    before = compile_stats()
    got, dec = _decode(model, True, schedule)
    assert got == want
    assert dec.compiled.calls > 20  # the decode steps ran compiled
    first = grown(before)  # one graph (a model compiled before in this process: this one is a 2nd cache entry)
    assert first["graphs"] == 1 and first["graph_breaks"] == 0 and first["recompiles"] <= 1, first
    after = compile_stats()
    schedule2 = {0: [(0, prompt(3), 6)], 2: [(1, prompt(17), 11), (2, prompt(1), 5)]}
    assert _decode(model, True, schedule2)[0] == _decode(model, False, schedule2)[0]
    assert grown(after) == {"graphs": 0, "recompiles": 0, "graph_breaks": 0}  # other shapes: no recompile


def test_compiled_paged_decode_greedy_equals_eager(single_process, tmp_path, monkeypatch):
    """GPT-2 tiny, fp64, the graph traced (``aot_eager``): greedy and sampled tokens equal the eager decoder's."""
    _check("tiny", "aot_eager", tmp_path, monkeypatch)


@pytest.mark.skipif(not FULL, reason="Inductor builds C++ for minutes: ZEROTRON_COMPILE=full (make test-compile)")
@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_compiled_paged_decode_inductor(preset, single_process, tmp_path, monkeypatch):
    """GPT-2 tiny and Llama tiny (grouped-query heads, RoPE), fp64, compiled by Inductor: the same."""
    _check(preset, "inductor", tmp_path, monkeypatch)



def test_serve_compile_cache_dir(tmp_path):
    """``serve --compile`` keeps Inductor's caches in the run directory (the trainer's
    ``<run>/inductor_cache``), so a restart reuses the compiled graph; a run where it cannot be
    created leaves Inductor's default (None)."""
    from zerotron.serve.command import compile_cache_dir

    step = tmp_path / "run" / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    assert compile_cache_dir(step) == tmp_path / "run" / "inductor_cache" and (tmp_path / "run" / "inductor_cache").is_dir()
    other = tmp_path / "exported_step"  # a step directory outside a run: nothing written into it
    other.mkdir()
    assert compile_cache_dir(other) is None and not (other / "inductor_cache").exists()
    blocked = tmp_path / "file_run"
    blocked.write_text("not a directory")
    assert compile_cache_dir(blocked / "checkpoints" / "step_1") is None
