"""Closed-form parameter and FLOP counts for the GPT-2-style decoder in ``zerotron.models.gpt``.

Pure arithmetic on the config numbers: nothing is allocated, so the counts are usable for models
far larger than this machine's memory (the ``zerotron memory --model`` path relies on that).
"""

from __future__ import annotations


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def gpt_num_params(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int,
                   bias: bool = True) -> int:
    """Number of parameters (a count, not bytes) of the GPT-2 decoder with tied embeddings.

    Formula (derived from the GPT-2 architecture, Radford et al. 2019, as laid out in nanoGPT),
    with C = n_embd, V = vocab_size, L = n_layer:

    * token embedding V*C (shared with the output head, so counted once) + positions block_size*C;
    * per block: attention qkv 3C^2 + output C^2, MLP 4C^2 + 4C^2 = 12C^2 weights; with ``bias``
      the Linear biases 3C + C + 4C + C = 9C and two LayerNorms (weight + bias) 4C, i.e. 13C;
      without bias only the two LayerNorm weights, 2C;
    * final LayerNorm: 2C with bias, C without.

    Total with bias: V*C + block_size*C + L*(12C^2 + 13C) + 2C (GPT-2 small: 124,439,808).
    ``n_head`` does not change the count (heads split C); it is checked to divide ``n_embd``.

    Raises ValueError for a non-positive size or when n_head does not divide n_embd.
    """
    _check_positive(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                    block_size=block_size)
    if n_embd % n_head != 0:
        raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
    c = n_embd
    per_block = 12 * c * c + (13 * c if bias else 2 * c)
    final_ln = 2 * c if bias else c
    return vocab_size * c + block_size * c + n_layer * per_block + final_ln


def training_flops_per_token(num_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), in floating-point operations.

    Formula: 6*N + 12*L*C*S (PaLM, Chowdhery et al. 2022, appendix B): 6N for the matmuls against
    the N weights (2N forward, 4N backward) plus 12*L*C*S for the attention score/value matmuls
    over a sequence of S tokens (L layers, width C). Multiply by tokens per second and divide by a
    peak FLOP/s to get MFU.

    Raises ValueError for a non-positive argument.
    """
    _check_positive(num_params=num_params, n_layer=n_layer, n_embd=n_embd, seq_len=seq_len)
    return 6 * num_params + 12 * n_layer * n_embd * seq_len
