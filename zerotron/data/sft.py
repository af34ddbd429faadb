"""Instruction data: chat and prompt/completion rows as fixed-length windows with a loss mask.

``data.format = "chat"``: each row (a ``.jsonl`` line or a ``.parquet`` row) holds ``messages``, a
list of ``{"role", "content"}`` with at least one ``assistant`` turn. The chat template (the
tokenizer's ``chat_template`` or ``data.chat_template``; Jinja, rendered in
``jinja2.sandbox.ImmutableSandboxedEnvironment`` with Hugging Face's ``apply_chat_template``
variables ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``) renders the whole
conversation. The assistant spans are found without generation markers: for assistant turn i the
text rendered for ``messages[:i]`` with the generation prompt and the text for ``messages[:i+1]``
must both be prefixes of the whole rendering, and the characters between them (the answer and the
template's end-of-turn text) are the assistant's. The rendering is cut into these segments, each
encoded on its own (``add_special_tokens=False``), and a token is a training target iff its segment
is an assistant span (the per-message tokenization of torchtune; it can differ from encoding the
whole text at once only where a BPE merge would cross a segment boundary).

``data.format = "prompt_completion"``: rows with ``prompt`` and ``completion`` strings; the tokens
are ``[bos] + prompt`` (masked) then ``completion + eos`` (trained).

Windows: every row occupies exactly S = ``seq_len`` positions of the token stream (row k at
``[k*S, (k+1)*S)``), right-padded with the pad id (``pad_token``, else the end token), and one pad
token ends the stream; so training window k of :func:`zerotron.data.windows.batch_from_indices`
is row k, and its targets are the row's next tokens where the mask is 1 and ``ignore_index``
elsewhere (padding, prompts, and the first token of the next row). Truncation rule: a row longer
than S tokens keeps its first S tokens (counted as ``truncated_rows``); a row with no target left
in its first S tokens is dropped (counted as ``dropped_rows``). The loss is normalised by the
global count of targets (``train.step``), so every layout matches one process. Validation takes
the last ``round(n * val_fraction)`` rows (at least one when there are two or more).

Packing (``data.doc_mask = true``): each row ends with the end token (the document separator of
:mod:`zerotron.parallel.context.docmask`; appended, not a target, unless the row already ends with
it, as prompt/completion rows do), and rows are laid out greedily in order: a row joins the
current window if it fits in what is left, else the window is padded to S and the row starts the
next one. With the document masks no row attends to another and each row's positions start at 0,
so a packed window trains exactly like its rows run alone. A row whose tokens hold the end token
before their last is refused (the mask would cut the conversation there; the chat template
renders it). The truncation rule is the same (a row longer than S keeps its first S tokens, its
end token included only if it fits, and fills a window alone); ``counts["windows"]`` is the
number of windows.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .corpus import DataError, read_text, source_files, text_lines
from .tokenizer import SpecialTokens

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")


def read_rows(path: str | Path) -> list[tuple[str, dict]]:
    """The rows of ``.jsonl`` / ``.parquet`` files under ``path`` (see ``corpus.source_files``) as
    ``(where, row)`` pairs, ``where`` naming ``file:line`` (or ``file:row``). Raises DataError for a
    ``.txt`` file, invalid JSON or a row that is not an object."""
    rows = []
    for f in source_files(path):
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            for lineno, line in enumerate(text_lines(read_text(f)), start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{f}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{f}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                rows.append((f"{f}:{lineno}", obj))
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DataError(f"{f}: reading .parquet needs pyarrow; pip install pyarrow or use .jsonl") from None
            rows += [(f"{f}:row {i + 1}", r) for i, r in enumerate(pq.read_table(f).to_pylist())]
        else:
            raise DataError(f"{f}: instruction data (data.format chat / prompt_completion) reads .jsonl or .parquet "
                            "rows; convert the file")
    if not rows:
        raise DataError(f"{path}: no rows; give a .jsonl file with one conversation per line")
    return rows


def compile_template(source: str):
    """A Jinja template compiled in ``ImmutableSandboxedEnvironment`` (trim_blocks, lstrip_blocks,
    ``raise_exception`` as Hugging Face templates use it). Raises DataError for a syntax error."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise DataError(f"the chat template does not compile: {e}; fix data.chat_template or the tokenizer's") from None


def _render(template, messages, gen: bool, sp: SpecialTokens, where: str) -> str:
    from jinja2 import TemplateError

    try:
        return template.render(messages=messages, add_generation_prompt=gen, bos_token=sp.bos or "",
                               eos_token=sp.eos)
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
        raise DataError(f"{where}: the chat template failed to render this row: {e}; fix the row or the "
                        "template (data.chat_template)") from None


def chat_segments(template, messages, sp: SpecialTokens, where: str) -> list[tuple[str, bool]]:
    """The rendered conversation cut into ``(text, is_assistant)`` segments (see the module).
    Raises DataError for bad messages, no assistant turn, a failed render, or a template whose
    message prefixes do not render as prefixes of the whole conversation."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: each message needs a role in {ROLES} and a string content, got {m!r}"[:300])
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the row has no assistant turn, so nothing would be trained; add one or drop the row")
    full = _render(template, messages, False, sp, where)
    cuts, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(template, messages[:i], True, sp, where)
        end = _render(template, messages[:i + 1], False, sp, where)
        if not (full.startswith(start) and full.startswith(end) and pos <= len(start) <= len(end)):
            raise DataError(f"{where}: the chat template does not render message prefixes as prefixes of the "
                            "conversation, so the assistant spans cannot be found; use a template without "
                            "look-ahead (data.chat_template)")
        cuts.append((len(start), len(end)))
        pos = len(end)
    segs, pos = [], 0
    for a, b in cuts:
        segs += [(full[pos:a], False), (full[a:b], True)]
        pos = b
    segs.append((full[pos:], False))
    return [s for s in segs if s[0]]


def row_tokens(tok, row: dict, fmt: str, template, sp: SpecialTokens, where: str) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of one row (mask 1: the token is a training target). Raises DataError."""
    if fmt == "chat":
        if "messages" not in row:
            raise DataError(f"{where}: missing field 'messages' (fields: {sorted(row)}); data.format = chat rows "
                            "hold messages: [{role, content}, ...]")
        segs = chat_segments(template, row["messages"], sp, where)
    else:
        p, c = row.get("prompt"), row.get("completion")
        if not isinstance(p, str) or not isinstance(c, str) or not c:
            raise DataError(f"{where}: data.format = prompt_completion rows need string 'prompt' and non-empty "
                            f"'completion' fields (fields: {sorted(row)})")
        segs = [((sp.bos or "") + p, False), (c + sp.eos, True)]
    ids, mask = [], []
    for text, train in segs:
        e = tok.encode(text, add_special_tokens=False).ids
        ids += e
        mask += [int(train)] * len(e)
    return ids, mask


def build_windows(tok, rows: list[tuple[str, dict]], fmt: str, sp: SpecialTokens, seq_len: int,
                  chat_template: str | None, pack: bool = False) -> tuple[np.ndarray, np.ndarray, dict]:
    """Lay the rows out as windows (see the module): ``(ids (n*S+1,) int64, mask (n*S+1,) uint8,
    counts)`` with counts ``rows``, ``truncated_rows``, ``dropped_rows``, ``target_tokens`` (and
    ``windows`` with ``pack``: several rows per window, each ended by ``sp.eos_id``).
    Raises DataError (a bad row, no chat template for chat data, no row left, with ``pack`` a row
    holding the end token before its last token)."""
    if fmt == "chat" and not chat_template:
        raise DataError("data.format = chat needs a chat template: the tokenizer has none; set data.chat_template")
    template = compile_template(chat_template) if fmt == "chat" else None
    S, pad, sep = seq_len, sp.pad_or_eos, sp.eos_id
    windows_ids, windows_mask, truncated, dropped, placed = [], [], 0, 0, 0
    untrained = 0  # dropped rows that have no target even untruncated (the template renders no assistant text)
    cur_ids: list[int] = []
    cur_mask: list[int] = []

    def close():
        if cur_ids:
            windows_ids.append(cur_ids + [pad] * (S - len(cur_ids)))
            windows_mask.append(cur_mask + [0] * (S - len(cur_mask)))
        return [], []

    for where, row in rows:
        ids, mask = row_tokens(tok, row, fmt, template, sp, where)
        if pack and ids:
            if sep in ids[:-1]:
                raise DataError(f"{where}: the row holds the end token {sp.eos!r} (the document separator of "
                                "data.doc_mask) inside itself, so packing would cut it there; use a chat template "
                                "that does not render it inside a conversation, or set data.doc_mask = false")
            if ids[-1] != sep:
                ids, mask = ids + [sep], mask + [0]
        trainable = any(mask[1:])
        if len(ids) > S:
            truncated += 1
            ids, mask = ids[:S], mask[:S]
        mask[0] = 0  # a row's first token is never a target (it follows the previous row or window)
        if not any(mask):
            dropped += 1
            untrained += not trainable
            continue
        if not pack or len(cur_ids) + len(ids) > S:
            cur_ids, cur_mask = close()
        cur_ids, cur_mask = cur_ids + ids, cur_mask + mask
        placed += 1
    close()
    if not windows_ids:
        if untrained == dropped:  # was "raise model.block_size", which cannot help: nothing of the assistant is rendered
            raise DataError(f"no row has a target token: the chat template renders none of the assistant turns' text "
                            f"(an empty assistant span in all {dropped} rows); use a template that renders the "
                            "assistant messages (data.chat_template or the tokenizer's)")
        raise DataError(f"no row has a target token within seq_len {S}; raise model.block_size or shorten the rows")
    ids = np.asarray([t for r in windows_ids for t in r] + [pad], dtype=np.int64)
    mask = np.asarray([t for r in windows_mask for t in r] + [0], dtype=np.uint8)
    counts = {"rows": placed, "truncated_rows": truncated, "dropped_rows": dropped, "target_tokens": int(mask.sum())}
    return ids, mask, {**counts, "windows": len(windows_ids)} if pack else counts
