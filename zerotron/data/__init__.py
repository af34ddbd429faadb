"""Data: corpora, byte-level BPE tokenizer, token caches, windows and the global-batch sampler.

Typical use::

    data = prepare_data("shakespeare", vocab_size=8192)        # builds or reuses the cache
    sampler = GlobalBatchSampler(num_windows(len(data.train), S), global_batch=G, seed=0)
    x, y = batch_from_indices(data.train, sampler.local_indices(step, dp_rank, dp_size), S)
"""
from .corpus import DataError, corpus_fingerprint, load_corpus, split_documents
from .dataset import cache_key, prepare_data
from .sampler import GlobalBatchSampler
from .token_cache import TokenData, load_token_data, token_dtype
from .tokenizer import EOT, SpecialTokens, load_tokenizer, read_special_tokens, train_bpe
from .windows import batch_from_indices, num_windows

__all__ = [
    "DataError", "load_corpus", "split_documents", "corpus_fingerprint",
    "EOT", "train_bpe", "load_tokenizer", "SpecialTokens", "read_special_tokens",
    "TokenData", "prepare_data", "load_token_data", "cache_key", "token_dtype",
    "num_windows", "batch_from_indices",
    "GlobalBatchSampler",
]
