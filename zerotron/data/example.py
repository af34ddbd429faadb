"""A small tokenizer directory shaped like Llama 3's, built offline (tests and the README's example).

:func:`llama3_style_tokenizer` trains a byte-level BPE with Llama 3's special tokens
(``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``,
``<|eot_id|>``; no ``<|endoftext|>``) and writes the three files a Llama 3 checkpoint carries:
``tokenizer.json`` (a post-processor prepends ``<|begin_of_text|>``), ``tokenizer_config.json``
(bos, eos = ``<|end_of_text|>``, the chat template below) and ``generation_config.json`` (both
``<|end_of_text|>`` and ``<|eot_id|>`` stop generation).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .corpus import DataError

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# each message: a header naming the role, a blank line, the content, <|eot_id|>; the generation
# prompt opens the assistant's header (the Llama 3 chat layout)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def llama3_style_tokenizer(texts: list[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train the tokenizer on ``texts`` and write ``out_dir/{tokenizer,tokenizer_config,
    generation_config}.json``; returns ``out_dir``. Special ids are 0..4 in :data:`SPECIALS`
    order. Raises DataError for no text or ``vocab_size`` < 261 (256 bytes + 5 specials)."""
    if vocab_size < 256 + len(SPECIALS):
        raise DataError(f"vocab_size must be >= {256 + len(SPECIALS)}, got {vocab_size}")
    if not any(texts):
        raise DataError("cannot train a tokenizer on no text; give it a non-empty corpus")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    bos = SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": tok.token_to_id(bos),
           "eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def word_level_tokenizer(words: list[str]):
    """A ``tokenizers.Tokenizer`` with one token per whitespace-separated word of ``words`` (ids from
    len(SPECIALS) + 1 on; "[UNK]" for any other word) and Llama 3's special tokens :data:`SPECIALS`
    (ids 0..4: <|end_of_text|> = 1), so token counts of a fixture can be done by hand (tests)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate([*SPECIALS, "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(list(SPECIALS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok
