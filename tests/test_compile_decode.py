"""Compiled decoding (``Engine(compile=True)``, ``zerotron.inference.compiled``): greedy tokens equal
the eager engine's, and once a (batch bucket, length bucket) pair has compiled, other prompt lengths
and batch sizes inside it compile nothing (TorchDynamo's counters, as ``train.compile``'s tests).

Inductor compiles C++ on this CPU (tens of seconds per graph on 2 loaded cores): the default suite
compiles ONE step graph (GPT-2 tiny with 2 layers, fp64, batch bucket 2, length bucket 16);
``ZEROTRON_COMPILE=full`` (``make test-compile``) adds GPT-2 fp32 and Llama fp32/fp64 with rows
leaving the batch (buckets 4 -> 2 -> 1) and a context that passes block_size (eager re-prefill)."""
import os

import pytest
import torch

from zerotron.inference.batch import Request
from zerotron.inference.compiled import batch_bucket, compile_refusal, length_bucket
from zerotron.inference.sampling import SamplingParams
from zerotron.models import registry

FULL = os.environ.get("ZEROTRON_COMPILE", "") == "full"
VOCAB = 97


def _model(preset: str, dtype, block: int):
    torch.manual_seed(0)  # 2 layers: the compile time grows with the graph (the whole model is one graph)
    model = registry.build_model(registry.preset_config(preset, vocab_size=VOCAB, block_size=block, n_layer=2))
    return model.to(dtype).eval()


def _requests(lengths, news, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(1, VOCAB, (n,), generator=g).tolist(), SamplingParams(max_tokens=m))
            for n, m in zip(lengths, news)]


def _engine(model, **kw):
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.inference.engine import Engine

    return Engine(model, Mesh(ParallelDims(1), torch.device("cpu")), **kw)


def test_buckets_and_refusal():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]
    assert [length_bucket(n, 256) for n in (1, 16, 17, 100, 256)] == [16, 16, 32, 128, 256]
    assert length_bucket(90, 96) == 96 and length_bucket(5, 8) == 8  # block_size caps the last bucket
    assert compile_refusal(1, 1, 1) == ""
    assert "tp=2" in compile_refusal(2, 1, 1) and "drop --compile" in compile_refusal(1, 2, 1)


def _check(preset, dtype, runs, block, single_process, tmp_path, monkeypatch):
    """Each run of ``runs`` (lengths, max_tokens): compiled greedy tokens == eager; the compile
    counters of the runs after the first stay flat. Returns the compile stats after the first run."""
    from zerotron.parallel.compile import compile_stats

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    model = _model(preset, dtype, block)
    eager, comp = _engine(model), _engine(model, compile=True)
    first = None
    for i, (lengths, news) in enumerate(runs):
        reqs = _requests(lengths, news, seed=1 + i)
        want = eager.generate(reqs)
        got = comp.generate(reqs)
        assert got == want, (preset, dtype, lengths)
        assert [len(o) for o in got] == list(news)
        stats = compile_stats()
        if first is None:
            first = stats
            assert stats["graphs"] >= 1 and stats["compile_time_s"] > 0
        else:  # inside the warmed-up buckets: no new graph, no recompile, no compile time
            assert {k: stats[k] for k in ("graphs", "recompiles", "graph_breaks")} == \
                {k: first[k] for k in ("graphs", "recompiles", "graph_breaks")}, (first, stats)
            assert stats["compile_time_s"] == first["compile_time_s"]
    return first


def test_compiled_greedy_equals_eager_and_no_recompile(single_process, tmp_path, monkeypatch):
    """GPT-2 tiny, fp64: a batch of 2 prompts (3 and 6 tokens, 8 new: bucket (2, 16)) warms up; then
    other prompt lengths, max_tokens and a batch of 2 in the same buckets compile nothing."""
    _check("tiny", torch.float64, [((3, 6), (8, 8)), ((5, 2), (7, 7)), ((1, 4), (9, 9))], 32,
           single_process, tmp_path, monkeypatch)


@pytest.mark.skipif(not FULL, reason="compiles several graphs: ZEROTRON_COMPILE=full (make test-compile)")
@pytest.mark.parametrize("preset,dtype", [("tiny", torch.float32), ("llama-tiny", torch.float32),
                                          ("llama-tiny", torch.float64)])
def test_compiled_greedy_equals_eager_full(preset, dtype, single_process, tmp_path, monkeypatch):
    """Rows leave at different steps (batch buckets 4 -> 2 -> 1, length bucket 32 = block_size);
    the second run (3 rows) reuses them; in the third a 20-token prompt + 16 new pass block_size
    (eager re-prefill of the cropped window, as the eager engine does) after compiled steps."""
    runs = [((3, 9, 1, 5), (12, 11, 10, 9)), ((2, 7, 4), (12, 10, 11)), ((20, 1, 12, 3), (16, 15, 14, 13))]
    _check(preset, dtype, runs, 32, single_process, tmp_path, monkeypatch)
