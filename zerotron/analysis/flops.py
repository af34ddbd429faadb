"""Closed-form parameter and FLOP counts for the decoders in ``zerotron.models`` (GPT-2 and Llama).

Pure arithmetic on the config numbers: nothing is allocated, so the counts are usable for models
far larger than this machine's memory (the ``zerotron memory --model`` path relies on that).
:class:`Shape` is what every estimator (memory, activations, planner) reads from a model config:
:func:`shape_of` takes a ``GPTConfig``, a ``LlamaConfig`` or any object with their fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class Shape:
    """The counts of a decoder-only transformer the estimators need (C = n_embd, H = n_head,
    H_kv = n_kv_head, D = C/H, F = ffn, V = vocab_size, L = n_layer).

    ``mlp_matrices``: 2 (Linear C->F, GELU, Linear F->C: GPT-2) or 3 (SwiGLU gate/up C->F, down
    F->C: Llama, Shazeer 2020). ``bias``: Linear biases (and LayerNorm biases). ``rms_norm``:
    RMSNorm (weight only; Zhang & Sennrich 2019) instead of LayerNorm. ``learned_positions``: a
    (block_size, C) position table (GPT-2; Llama uses RoPE, no parameters). ``tied``: output head
    shares the token embedding. Hashable (estimators cache on it)."""

    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    ffn: int
    mlp_matrices: int = 2
    bias: bool = True
    rms_norm: bool = False
    learned_positions: bool = True
    tied: bool = True
    dropout: float = 0.0
    n_experts: int = 0  # mixture of experts (0 = dense): E SwiGLU experts of width ffn per block
    top_k: int = 0  # experts per token
    shared_ffn: int = 0  # width of a shared SwiGLU expert (0 = none)
    qkv_linears: int = 1  # Linears projecting q/k/v: 1 fused (GPT-2's c_attn), 3 separate (Llama's q/k/v_proj)

    def tp_sizes(self) -> dict:
        """The sizes the tensor-parallel rule (:func:`zerotron.models.layout.tp_refusal`) checks,
        named as the model config names them: n_head, n_kv_head and, for SwiGLU, intermediate_size
        (GELU's 4C needs no entry: n_head | C)."""
        if self.n_experts:  # experts replicated over tp, a shared expert split
            return {"n_head": self.n_head, "n_kv_head": self.n_kv_head, "intermediate_size": self.shared_ffn or None}
        return {"n_head": self.n_head, "n_kv_head": self.n_kv_head,
                "intermediate_size": self.ffn if self.mlp_matrices == 3 else None}

    @property
    def head_dim(self) -> int:
        """D = C / H."""
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        """H_kv * D, the width of the k and v projections (C for multi-head attention)."""
        return self.n_kv_head * self.head_dim

    @property
    def column_linears(self) -> int:
        """Column-parallel Linears of one block under tensor parallelism (``models.*.layout``'s
        ``block_tp``): the q/k/v projection(s) and the MLP's input matrices (GELU's fc; SwiGLU's
        gate and up; a MoE block only its shared expert's, the experts stay replicated). Each takes
        the block's (replicated or, with SP, gathered) input on its own."""
        if self.n_experts:
            return self.qkv_linears + (2 if self.shared_ffn else 0)
        return self.qkv_linears + self.mlp_matrices - 1

    @property
    def row_linears(self) -> int:
        """Row-parallel Linears of one block: attention's output projection and the MLP's output
        (a MoE block's only with a shared expert)."""
        return 1 + (bool(self.shared_ffn) if self.n_experts else 1)

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: 2C (LayerNorm with bias), C (RMSNorm or LayerNorm without)."""
        return 2 * self.n_embd if self.bias and not self.rms_norm else self.n_embd

    def block_matmul_params(self) -> int:
        """Weights of one block's matmuls: q C*C + k, v 2*C*H_kv*D + o C*C + MLP m*C*F
        (GPT-2: 12C^2); a MoE block counts what one token uses: router C*E + k experts 3*C*F + the
        shared expert 3*C*F_shared."""
        c = self.n_embd
        if self.n_experts:
            return (2 * c * c + 2 * c * self.kv_dim + c * self.n_experts + self.top_k * 3 * c * self.ffn
                    + 3 * c * self.shared_ffn)
        return 2 * c * c + 2 * c * self.kv_dim + self.mlp_matrices * c * self.ffn

    def block_params(self, tp: int = 1) -> int:
        """Parameters of one block held by one of ``tp`` tensor-parallel ranks (Megatron split,
        Shoeybi et al. 2019): column-parallel q/k/v and first MLP matrices (weights and biases) and
        row-parallel o/last MLP weights divided by tp; row-parallel biases and norms replicated.
        Exact when tp divides H, H_kv and F (what tensor parallelism requires)."""
        c, f, m = self.n_embd, self.ffn, self.mlp_matrices
        if self.n_experts:  # attention split, router and experts replicated, shared expert split
            s = self.shared_ffn
            return ((c * (c + 2 * self.kv_dim) + c * c + 3 * c * s) // tp + c * self.n_experts
                    + self.n_experts * 3 * c * f + 2 * self.norm_params)
        col_w = c * (c + 2 * self.kv_dim) + (m - 1) * c * f
        row_w = c * c + f * c
        col_b = c + 2 * self.kv_dim + (m - 1) * f if self.bias else 0
        row_b = 2 * c if self.bias else 0
        return col_w // tp + row_w // tp + col_b // tp + row_b + 2 * self.norm_params

    def embedding_params(self, tp: int = 1) -> int:
        """Token embedding rows ceil(V/tp) * C (vocab-parallel) + the position table (replicated)."""
        return -(-self.vocab_size // tp) * self.n_embd + (self.block_size * self.n_embd if self.learned_positions else 0)

    def output_params(self, tp: int = 1) -> int:
        """Output-layer parameters of one tp rank not shared with the embedding: ceil(V/tp) * C if
        untied, 0 if tied."""
        return 0 if self.tied else -(-self.vocab_size // tp) * self.n_embd

    def num_params(self) -> int:
        """Total parameters, a tied head counted once."""
        return (self.embedding_params() + self.n_layer * self.block_params() + self.norm_params
                + self.output_params())

    def active_params(self) -> int:
        """Parameters one token uses: :meth:`num_params` less the (E - k) experts per block it skips
        (equal to num_params for a dense model)."""
        skipped = (self.n_experts - self.top_k) * 3 * self.n_embd * self.ffn if self.n_experts else 0
        return self.num_params() - self.n_layer * skipped

    def flop_params(self) -> int:
        """N of the 6N FLOP rule: :meth:`active_params` (a MoE token runs k experts, not E) without
        an untied token embedding (a lookup, not a matmul; a tied one is the output layer's matmul
        and stays). GPT-2's small position table stays in, as in the published GPT-2 counts."""
        return self.active_params() - (0 if self.tied else self.vocab_size * self.n_embd)

    def kv_cache_bytes(self, batch: int, seq: int, bytes_per_elem: int = 2, tp: int = 1) -> int:
        """Bytes of the inference KV cache for ``batch`` sequences of ``seq`` tokens on one of
        ``tp`` ranks: 2 (k and v) * L * batch * seq * H_kv/tp * D * bytes (GQA keeps H_kv, not H,
        heads: Ainslie et al. 2023)."""
        return 2 * self.n_layer * batch * seq * (self.n_kv_head // tp) * self.head_dim * bytes_per_elem


def shape_of(cfg) -> Shape:
    """The :class:`Shape` of a model config: a Llama config (it has ``intermediate_size``) gets
    SwiGLU, RMSNorm, RoPE, its n_kv_head and tie_word_embeddings (a Mixtral config also its
    n_experts, experts_top_k and shared expert); a GPT-2 config the 4C GELU MLP,
    LayerNorm, learned positions, a tied head and n_kv_head = n_head. Raises ValueError for
    non-positive sizes, n_head not dividing n_embd or n_kv_head not dividing n_head. A
    :class:`Shape` is returned as it is."""
    if isinstance(cfg, Shape):
        return cfg
    llama = getattr(cfg, "intermediate_size", None) is not None
    shape = Shape(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=getattr(cfg, "n_kv_head", cfg.n_head),
        n_embd=cfg.n_embd, vocab_size=cfg.vocab_size, block_size=cfg.block_size,
        ffn=cfg.intermediate_size if llama else 4 * cfg.n_embd, mlp_matrices=3 if llama else 2,
        bias=bool(getattr(cfg, "bias", not llama)) and not llama, rms_norm=llama,
        learned_positions=not llama, tied=bool(getattr(cfg, "tie_word_embeddings", True)) if llama else True,
        dropout=float(getattr(cfg, "dropout", 0.0)), n_experts=int(getattr(cfg, "n_experts", 0) or 0),
        top_k=int(getattr(cfg, "experts_top_k", 0) or 0),
        shared_ffn=int(getattr(cfg, "moe_shared_intermediate_size", 0) or 0), qkv_linears=3 if llama else 1)
    _check_positive(n_layer=shape.n_layer, n_head=shape.n_head, n_kv_head=shape.n_kv_head,
                    n_embd=shape.n_embd, vocab_size=shape.vocab_size, block_size=shape.block_size,
                    ffn=shape.ffn)
    if shape.n_embd % shape.n_head or shape.n_head % shape.n_kv_head:
        raise ValueError(f"n_embd ({shape.n_embd}) must be divisible by n_head ({shape.n_head}) and n_head "
                         f"by n_kv_head ({shape.n_kv_head})")
    return shape


def num_params(cfg) -> int:
    """Parameter count of the model of config ``cfg`` (any family, see :func:`shape_of`)."""
    return shape_of(cfg).num_params()


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


def llama_num_params(n_layer: int, n_head: int, n_kv_head: int, n_embd: int, intermediate_size: int,
                     vocab_size: int, tie_word_embeddings: bool = False) -> int:
    """Number of parameters of the Llama decoder (Touvron et al. 2023), C = n_embd, F =
    intermediate_size, D = C/n_head, L = n_layer, V = vocab_size:

    * token embedding V*C, plus an untied output head V*C (tied: counted once);
    * per block: q and o 2C^2, grouped-query k and v 2*C*n_kv_head*D (Ainslie et al. 2023),
      SwiGLU gate, up and down 3*C*F (Shazeer 2020), two RMSNorm weights 2C; no biases, no
      position parameters (RoPE);
    * final RMSNorm: C.

    Total: V*C*(1 or 2) + L*(2C^2 + 2*C*n_kv_head*D + 3CF + 2C) + C (Llama-3-8B: 8,030,261,248).
    Raises ValueError for a non-positive size or n_head not dividing n_embd / n_kv_head not
    dividing n_head."""

    return num_params(SimpleNamespace(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                                      intermediate_size=intermediate_size, vocab_size=vocab_size,
                                      block_size=1, tie_word_embeddings=tie_word_embeddings))


def training_flops_per_token(num_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token (forward + backward), in floating-point operations.

    Formula: 6*N + 12*L*C*S (PaLM, Chowdhery et al. 2022, appendix B): 6N for the matmuls against
    the N weights (2N forward, 4N backward) plus 12*L*C*S for the attention score/value matmuls
    over a sequence of S tokens (L layers, width C; grouped-query attention changes only N, its
    H*D = C query channels still meet every key). Multiply by tokens per second and divide by a
    peak FLOP/s to get MFU. For N use :meth:`Shape.flop_params` (an untied embedding is no matmul).

    Raises ValueError for a non-positive argument.
    """
    _check_positive(num_params=num_params, n_layer=n_layer, n_embd=n_embd, seq_len=seq_len)
    return 6 * num_params + 12 * n_layer * n_embd * seq_len


def recompute_flops(shape: Shape, S: int, recompute: str) -> float:
    """FLOPs per token and layer that recomputation adds (``parallel.recompute``): none 0;
    selective 2(h^2 + 2h H_kv D) + 4hS, the attention sub-layer's q/k/v projections and the
    attention (scores and values) again; full 2(W - hF) + 4hS, the whole block again but its last
    matmul (the MLP's down projection, h x F). Neither re-runs its sub-layer's last matmul (the
    output projection, the down projection): torch's non-reentrant checkpoint stops recomputing as
    soon as the tensors the backward saved are rebuilt (its early stop), and no backward needs that
    matmul's output (found by the dry run's FLOP count, ``tests/test_dryrun.py``)."""
    h = shape.n_embd
    attn = 2 * (h * h + 2 * h * shape.kv_dim) + 4 * h * S
    full = 2 * (shape.block_matmul_params() - h * shape.ffn) + 4 * h * S
    return {"none": 0, "selective": attn, "full": full}[recompute]


def m_flops(shape: Shape, b: int, S: int, layers: int, last: bool, tp: int, recompute: str) -> float:
    """Matmul + attention FLOPs of one micro-batch (``b`` sequences of ``S`` tokens) on a pipeline
    rank holding ``layers`` transformer blocks (and the output layer if ``last``), forward +
    backward, per tp rank (the planner's cost model, :mod:`zerotron.analysis.cost_model`: 6W + 12hS per token and layer, PaLM appendix B;
    recomputation adds 2W + 4hS (full) or 4hS (selective); the output layer 6hV). The figure a
    dry run's FLOP counter reads off the traced step (``zerotron.analysis.trace_time``)."""
    h, W = shape.n_embd, shape.block_matmul_params()
    extra = recompute_flops(shape, S, recompute)
    return b * S * (layers * (6 * W + 12 * h * S + extra) + (6 * h * shape.vocab_size if last else 0)) / tp
