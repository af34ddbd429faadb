"""Data: corpora, byte-level BPE tokenizer, token caches, windows and the global-batch sampler.

Typical use::

    data = prepare_data("shakespeare", vocab_size=8192)        # builds or reuses the cache
    sampler = GlobalBatchSampler(num_windows(len(data.train), S), global_batch=G, seed=0)
    x, y = batch_from_indices(data.train, sampler.local_indices(step, dp_rank, dp_size), S)

The names below are imported on first use (PEP 562): a torch-free part such as
:func:`zerotron.data.sft.compile_template` (the HTTP front-end process of ``zerotron serve``
renders chat templates with it) does not pull in torch through :mod:`~zerotron.data.dataset`.
"""
from __future__ import annotations

import importlib

__all__ = [
    "DataError", "load_corpus", "split_documents", "corpus_fingerprint",
    "EOT", "train_bpe", "load_tokenizer", "SpecialTokens", "read_special_tokens",
    "TokenData", "prepare_data", "load_token_data", "cache_key", "token_dtype",
    "num_windows", "batch_from_indices",
    "GlobalBatchSampler",
]

_HOME = {**dict.fromkeys(("DataError", "corpus_fingerprint", "load_corpus", "split_documents"), ".corpus"),
         **dict.fromkeys(("cache_key", "prepare_data"), ".dataset"),
         **dict.fromkeys(("TokenData", "load_token_data", "token_dtype"), ".token_cache"),
         **dict.fromkeys(("batch_from_indices", "num_windows"), ".windows"),
         "GlobalBatchSampler": ".sampler",
         **dict.fromkeys(("EOT", "SpecialTokens", "load_tokenizer", "read_special_tokens", "train_bpe"), ".tokenizer")}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)
