"""The inference engine (zerotron.inference): batched KV-cached generation equals one-by-one, the
uncached loop and transformers' generate; greedy and sampled outputs are identical on every layout
(single, dp, tp, naive-mp, pp with micro-batches, pp x tp, pp x dp) for GPT-2 and Llama, in fp64.

One spawn of 4 processes covers every multi-process layout; the references run in the pytest process."""
import copy

import pytest
import torch

from zerotron.inference.batch import Request
from zerotron.inference.sampling import SamplingParams, filter_logits
from zerotron.models import registry
from zerotron.testing import run_ranks

VOCAB, BLOCK, NEW = 97, 16, 12  # prompts of up to 9 tokens + 12 new ones cross block_size (cache rebuilt)
LENGTHS = (3, 9, 1, 5)


def _model(preset: str):
    torch.manual_seed(0)
    model = registry.build_model(registry.preset_config(preset, vocab_size=VOCAB, block_size=BLOCK))
    return model.double().eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _requests(sampled: bool, eos: bool = False):
    out = []
    for i, p in enumerate(_prompts()):
        sp = SamplingParams(max_tokens=NEW - i, temperature=0.8, top_k=30, top_p=0.9, seed=7 + i) if sampled \
            else SamplingParams(max_tokens=NEW - i)
        out.append(Request(p, sp))
    return out


def _local_engine(model, **kw):
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.inference.engine import Engine

    return Engine(model, Mesh(ParallelDims(1), torch.device("cpu")), **kw)


def _uncached_greedy(model, prompt, n):
    """The textbook loop: the whole (cropped) sequence through the model for every token."""
    idx = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(idx[:, -BLOCK:])[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
    return idx[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_batched_equals_one_by_one_uncached_and_model_generate(preset, single_process):
    model = _model(preset)
    eng = _local_engine(model)
    reqs = _requests(False)
    batched = eng.generate(reqs)
    assert [len(o) for o in batched] == [r.params.max_tokens for r in reqs]
    assert batched == [eng.generate([r])[0] for r in reqs]
    assert batched == [_uncached_greedy(model, r.prompt, r.params.max_tokens) for r in reqs]
    assert batched[:2] == [model.generate(torch.tensor([r.prompt]), r.params.max_tokens, temperature=0)[0,
                           len(r.prompt):].tolist() for r in reqs[:2]]
    # sampling: a request's tokens depend neither on its batch nor on its row
    s = _requests(True)
    sampled = eng.generate(s)
    assert sampled == [eng.generate([r])[0] for r in s[:2]] + _local_engine(model, max_batch=1).generate(s[2:])
    assert sampled == _local_engine(model, max_batch=3).generate(s[::-1])[::-1]
    assert sampled != [o[:len(x)] for o, x in zip(batched, sampled)]  # the sampler is really sampling


def test_eos_stops_a_request_and_others_go_on(single_process):
    model = _model("tiny")
    reqs = _requests(False)
    full = _local_engine(model).generate(reqs)
    eos = full[1][3]  # the 4th token request 1 emits
    got = _local_engine(model, eos_id=eos).generate(reqs)
    for o, f in zip(got, full):
        cut = f[:f.index(eos) + 1] if eos in f else f
        assert o == cut
    assert got[1] == full[1][:full[1].index(eos) + 1] and len(got[1]) < len(full[1])


def test_stop_strings_end_a_request_at_the_completing_token(single_process):
    """A stop string ends a row as soon as its decoded new text contains it (other rows go on), the
    static KV cache included (its capacity is the longest row); without a decode function: refused."""
    import dataclasses

    model = _model("tiny")
    reqs = _requests(False)
    full = _local_engine(model).generate(reqs)
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731 - a stop may span tokens
    a, b = full[1][2], full[1][3]
    stop = (f"{a}><{b}>",)
    got = _local_engine(model, decode=decode).generate(
        [Request(r.prompt, dataclasses.replace(r.params, stop=stop)) for r in reqs])
    for o, f in zip(got, full):
        ends = [k + 1 for k in range(1, len(f)) if (f[k - 1], f[k]) == (a, b)]
        assert o == (f[:ends[0]] if ends else f)
    assert len(got[1]) < len(full[1])  # really ended early
    with pytest.raises(ValueError, match="decode"):
        _local_engine(model).generate([Request(reqs[0].prompt, SamplingParams(stop=("x",)))])


def test_top_k_top_p_filters():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0], dtype=torch.float64)
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)).tolist() == [False, True, False, True]
    p = logits.softmax(-1)  # 0.64, 0.09, 0.24, 0.03: top_p 0.7 keeps the first two by mass
    assert p[0] < 0.7 < p[0] + p[2]
    assert torch.isinf(filter_logits(logits, 1.0, None, 0.7)).tolist() == [False, True, False, True]
    assert torch.isinf(filter_logits(logits, 1.0, None, 0.5)).tolist() == [False, True, True, True]


def test_tiny_temperature_samples_the_argmax():
    # 1e-320 is a finite temperature > 0 that serve and generate accept; logits / 1e-320 overflowed to
    # inf, softmax gave NaN and torch.multinomial raised (serve answered 500 to every row of the batch)
    from zerotron.inference.sampling import make_generator, sample_rows

    logits = torch.tensor([[3.0, 1.0, 2.0, -1.0]], dtype=torch.float32)
    for t in (1e-320, 5e-324, 1e-300):
        for top_k, top_p in ((None, 1.0), (2, 1.0), (None, 0.5)):
            assert filter_logits(logits[0].double(), t, top_k, top_p).softmax(-1).tolist() == [1.0, 0.0, 0.0, 0.0]
        params = SamplingParams(temperature=t, top_k=3).validate()
        assert sample_rows(logits, [params], [make_generator(0)]).tolist() == [0]
    row = logits[0].double()  # an ordinary temperature is applied as before, bit for bit
    assert torch.equal(filter_logits(row, 0.7, None, 1.0), row / 0.7)


@pytest.mark.parametrize("bad, word", [(dict(max_tokens=-1), "max_tokens"), (dict(temperature=float("nan")),
                                       "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"),
                                      (dict(stop=("",)), "stop"), (dict(stop="x"), "stop")])
def test_bad_sampling_params(bad, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**bad).validate()


def test_equals_transformers_generate_on_export(tmp_path, single_process):
    """Our batched greedy decoding with eos equals transformers' generate of the exported GPT-2 (one
    prompt at a time, eos = the exported eos id, which the tiny model does emit)."""
    transformers = pytest.importorskip("transformers")
    model = _model("tiny")
    reqs = _requests(False)
    eos = _local_engine(model).generate(reqs)[0][2]
    registry.export_hf(model, tmp_path / "hf", eos_token_id=eos)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float64).eval()
    ours = _local_engine(model, eos_id=eos).generate([Request(r.prompt, SamplingParams(max_tokens=8))
                                                      for r in reqs])
    with torch.no_grad():
        for r, o in zip(reqs, ours):
            ref = hf.generate(torch.tensor([r.prompt]), max_new_tokens=8, do_sample=False, pad_token_id=eos,
                              eos_token_id=eos)[0, len(r.prompt):].tolist()
            assert o == ref, (r.prompt, o, ref)
    assert any(len(o) < 8 for o in ours)  # eos really stopped something


LAYOUTS = [  # (name, dp, tp, pp, microbatches) on 4 ranks
    ("dp4", 4, 1, 1, 1), ("tp2xdp2", 2, 2, 1, 1), ("naive-mp2xdp2", 2, 1, 2, 1), ("pp2xdp2_m3", 2, 1, 2, 3),
    ("pp2xtp2_m2", 1, 2, 2, 2), ("pp4_m4", 1, 1, 4, 4), ("tp4", 1, 4, 1, 1),
]


def _layouts_worker(presets):
    import torch.distributed as dist

    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.inference.engine import Engine

    out = {}
    for preset in presets:
        dense = _model(preset)
        for name, dp, tp, pp, m in LAYOUTS:
            if preset == "llama-tiny" and tp == 4:
                continue  # n_kv_head 2: tp must divide it
            mesh = Mesh(ParallelDims(dist.get_world_size(), dp, tp, pp), torch.device("cpu"))
            eng = Engine(copy.deepcopy(dense), mesh, microbatches=m)
            out[(preset, name)] = (eng.generate(_requests(False)), eng.generate(_requests(True)),
                                   eng.weight_bytes(), eng.stats.kv_cache_bytes)
    return out


def test_every_layout_equals_single_process(single_process):
    presets = ["tiny", "llama-tiny"]
    ref = {}
    for preset in presets:
        eng = _local_engine(_model(preset))
        ref[preset] = (eng.generate(_requests(False)), eng.generate(_requests(True)), eng.weight_bytes())
    results = run_ranks(_layouts_worker, 4, presets, timeout_s=120)
    for rank, res in enumerate(results):
        for (preset, name), (greedy, sampled, wbytes, kv) in res.items():
            assert greedy == ref[preset][0], (rank, preset, name)
            assert sampled == ref[preset][1], (rank, preset, name)
            dense_w = ref[preset][2]
            if name.startswith("tp4") or name.startswith("tp2"):
                assert wbytes < 0.6 * dense_w, (name, wbytes, dense_w)
            elif "pp" in name or "mp" in name:
                assert wbytes < dense_w and kv > 0, (name, wbytes, dense_w)
            else:
                assert wbytes == dense_w


def test_microbatch_and_decode_splits():
    from zerotron.inference.pipelined import decode_split, split_microbatches

    assert [list(r) for r in split_microbatches(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in split_microbatches(2, 4)] == [[0], [1]]  # never an empty micro-batch
    assert decode_split(4, 2, 128, 4096) == "3,1"  # head = 4096 / (12 * 128) = 2.7 blocks
    assert decode_split(6, 2, 384, 4096) == "3,3"  # head 0.9 blocks: equal counts stay best
    assert decode_split(4, 4, 64, 64) == "1,1,1,1"
