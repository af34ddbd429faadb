"""Packing instruction rows with document masks (``data.doc_mask = true`` with ``data.format = chat |
prompt_completion``, issue 34): several conversations per window, each ended by the end token, never
attending to another, positions restarting, loss masks kept. Checked: the layout and the masked-token
counts against a hand count (with the truncation rule), packed windows against each conversation run
alone (fp64, loss and every gradient), and packed training over cp 2 (ring; ZEROTRON_SFT_FULL=1 adds
dp2, tp2+SP and pp2) against one process with the parity machinery."""
from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch

from zerotron.data.example import word_level_tokenizer

CHAT = "configs/chat_example.jsonl"
TMPL = ("{{ bos_token }}{% for m in messages %} <|start_header_id|> {{ m['role'] }} <|end_header_id|> "
        "{{ m['content'] }} <|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %} <|start_header_id|> assistant <|end_header_id|> {% endif %}")


def _fixture():
    from zerotron.data.tokenizer import SpecialTokens

    tok = word_level_tokenizer("system user assistant be brief hi there hello friend a b c d e f g why so".split())
    sp = SpecialTokens(eos="<|end_of_text|>", eos_id=1, eos_ids=(1, 4), bos="<|begin_of_text|>", bos_id=0)
    m = lambda r, c: {"role": r, "content": c}  # noqa: E731
    rows = [("r1", {"messages": [m("system", "be brief"), m("user", "hi there"), m("assistant", "hello friend")]}),
            ("r2", {"messages": [m("user", "a b"), m("assistant", "c"), m("user", "d"), m("assistant", "e f g")]}),
            ("r3", {"messages": [m("user", "why"), m("assistant", "so")]})]
    return tok, sp, rows


def test_packed_layout_equals_a_hand_count():
    """By hand (a turn = header, role, end header, its words, <|eot_id|>): r1 = bos + 6 + 6 + 6 = 19
    tokens + the end token = 20, 3 targets; r2 = bos + 6 + 5 + 5 + 7 = 24 + 1 = 25, 2 + 4 targets;
    r3 = bos + 5 + 5 = 11 + 1 = 12, 2 targets. Packed greedily in order, the truncation rule
    counted; a row holding the end token inside is refused in one line."""
    from zerotron.data import DataError
    from zerotron.data.sft import build_windows

    tok, sp, rows = _fixture()
    ids, mask, c = build_windows(tok, rows, "chat", sp, 48, TMPL, pack=True)
    # S = 48: r1 + r2 = 45 fit the first window, r3 starts the second
    assert c == {"rows": 3, "truncated_rows": 0, "dropped_rows": 0, "target_tokens": 11, "windows": 2}
    assert ids.size == 2 * 48 + 1 and [i for i in range(ids.size) if ids[i] == 1 and i < 60] == [19, 44, 45, 46, 47, 59]
    assert ids[0] == ids[20] == ids[48] == 0  # each conversation starts with its bos
    trained = [tok.id_to_token(int(t)) for t, k in zip(ids, mask) if k]
    assert trained == ["hello", "friend", "<|eot_id|>", "c", "<|eot_id|>", "e", "f", "g", "<|eot_id|>", "so", "<|eot_id|>"]
    assert mask[19] == mask[44] == mask[20] == 0  # the appended end token and a row's first token: no target
    # unpacked (doc_mask off): one row per window, the same targets
    _, umask, u = build_windows(tok, rows, "chat", sp, 48, TMPL)
    assert u == {"rows": 3, "truncated_rows": 0, "dropped_rows": 0, "target_tokens": 11} and umask.size == 3 * 48 + 1
    # S = 22: r1 (20) alone; r2 keeps its first 22 tokens (up to "e f" of its last answer: c, eot, e, f
    # trained) and fills a window; r3 (12) the third
    _, _, c22 = build_windows(tok, rows, "chat", sp, 22, TMPL, pack=True)
    assert c22 == {"rows": 3, "truncated_rows": 1, "dropped_rows": 0, "target_tokens": 3 + 4 + 2, "windows": 3}
    # S = 12: r1 keeps bos, the system turn and 5 tokens of the user turn: no target, dropped; r2 keeps
    # "c <|eot_id|>" (exactly 12 tokens, its end token cut); r3 is exactly 12 with its end token
    _, _, c12 = build_windows(tok, rows, "chat", sp, 12, TMPL, pack=True)
    assert c12 == {"rows": 2, "truncated_rows": 2, "dropped_rows": 1, "target_tokens": 2 + 2, "windows": 2}
    # prompt/completion rows already end with the end token (trained): nothing appended
    pc = [("p1", {"prompt": "a b", "completion": "why so"}), ("p2", {"prompt": "c", "completion": "d e"})]
    ids, mask, c = build_windows(tok, pc, "prompt_completion", sp, 16, None, pack=True)
    assert c == {"rows": 2, "truncated_rows": 0, "dropped_rows": 0, "target_tokens": 6, "windows": 1}
    # ids: specials 0..4, [UNK] 5, then the words in order (a 15, b 16, c 17, d 18, e 19, why 22, so 23)
    assert ids[:12].tolist() == [0, 15, 16, 22, 23, 1, 0, 17, 18, 19, 1, 1] and ids.size == 17
    assert [int(t) for t, k in zip(ids, mask) if k] == [22, 23, 1, 18, 19, 1]
    with pytest.raises(DataError, match="inside itself") as e:
        build_windows(tok, rows, "chat", sp, 48, "{% for m in messages %}{{ m['content'] }} {{ eos_token }} {% endfor %}",
                      pack=True)
    assert "\n" not in str(e.value) and "r1" in str(e.value)


def test_packed_equals_each_conversation_alone():
    """fp64, one process, a Llama: the packed windows with document masks (loss summed over every
    target, divided by the count) equal running each conversation alone from position 0 (same
    targets, same normaliser): loss and every gradient within rtol 1e-10; without the masks the loss
    differs (the test can fail)."""
    from zerotron.data.dataset import batch_from_indices
    from zerotron.data.sft import build_windows
    from zerotron.models.llama import Llama, LlamaConfig
    from zerotron.parallel.base import IGNORE_INDEX, token_loss_sum
    from zerotron.parallel.context.docmask import apply_doc_mask

    tok, sp, rows = _fixture()
    S = 48
    ids, mask, c = build_windows(tok, rows, "chat", sp, S, TMPL, pack=True)
    x, y = batch_from_indices(ids, [0, 1], S, mask=mask, ignore_index=IGNORE_INDEX)
    n = int((y != IGNORE_INDEX).sum())
    assert n == c["target_tokens"] == 11
    torch.manual_seed(0)
    ref = Llama(LlamaConfig(vocab_size=tok.get_vocab_size(), block_size=S, n_layer=2, n_head=4, n_kv_head=2,
                            n_embd=32, intermediate_size=64)).double()
    packed = copy.deepcopy(ref)
    hooks = apply_doc_mask(packed, sp.eos_id)
    with hooks.documents(x):
        loss = token_loss_sum(packed(x), y) / n
    loss.backward()
    uids, umask, _ = build_windows(tok, rows, "chat", sp, S, TMPL)
    ux, uy = batch_from_indices(uids, [0, 1, 2], S, mask=umask, ignore_index=IGNORE_INDEX)
    ref_loss = 0.0
    for k, length in enumerate((19, 24, 11)):  # each conversation alone, without padding
        piece = token_loss_sum(ref(ux[k:k + 1, :length]), uy[k:k + 1, :length]) / n
        piece.backward()
        ref_loss += float(piece.detach())
    assert abs(float(loss.detach()) - ref_loss) <= 1e-10 * abs(ref_loss), (float(loss), ref_loss)
    worst = max(float((p.grad - q.grad).norm() / q.grad.norm())
                for p, q in zip(packed.parameters(), ref.parameters()))
    assert worst <= 1e-10, worst
    with torch.no_grad():
        plain = float(token_loss_sum(ref(x), y) / n)
    assert abs(plain - ref_loss) > 1e-6


# the default suite runs cp 2 (ring attention with the documents of each packed window);
# ZEROTRON_SFT_FULL=1 adds dp2, tp2+SP and pp2 1F1B (make test-finetune)
PACK_LAYOUTS = ("ddp-dp1-cp2-ring-acc4",) + (
    ("ddp-dp2-acc4", "ddp-dp1-tp2sp-acc4", "ddp-dp1-pp2-1f1b-acc4") if os.environ.get("ZEROTRON_SFT_FULL") else ())


def test_packed_sft_parity_fp64(tmp_path, chat_tokenizer, single_process, report):
    """Packed chat windows (several conversations each) with document masks, fp64: the layouts equal
    one process (rtol 1e-10)."""
    from zerotron import parity
    from zerotron.data import prepare_data
    from zerotron.train.setup import data_kwargs

    extra = {"data.corpus": "files", "data.path": CHAT, "data.format": "chat", "data.tokenizer": str(chat_tokenizer),
             "data.cache_dir": str(tmp_path / "cache"), "model.block_size": 128, "model.n_layer": 4,
             "data.doc_mask": "true"}
    meta = prepare_data(**data_kwargs(parity.config_for(parity.Layout("ddp", 1, 1, False, 1, None, 1), extra))).meta
    assert meta["train_windows"] < meta["train_rows"], meta  # packed: windows hold several conversations
    ref = parity.reference(str(tmp_path / "ref"), extra)
    lays = [dataclasses.replace(lay, doc_mask=True).as_dict() for lay in parity.all_layouts() if lay.name in PACK_LAYOUTS]
    assert len(lays) == len(PACK_LAYOUTS)
    worst = parity.parity_worst(lays, ref, tmp_path, extra)
    report(f"packed SFT parity fp64 (chat, doc masks, {meta['train_rows']} rows in {meta['train_windows']} windows), "
           "worst relative error: " + ", ".join(f"{k} {v:.2g}" for k, v in worst.items()))
