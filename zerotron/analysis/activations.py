"""Activation memory of GPT-2 and Llama training: closed-form estimate per layer / per pipeline
rank, and a measurement of what autograd actually saves.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(section 4 and Table 2). s sequence length, b micro-batch, h hidden size, a heads, t tensor-parallel
degree, all sizes in elements; results in bytes. Their per-layer count (16-bit activations,
dropout on, 1-byte dropout masks, attention as explicit matmuls + softmax):

    attention: QKV input 2sbh, Q and K 4sbh, softmax output 2as^2b, softmax dropout mask as^2b,
               dropout output 2as^2b, V 2sbh, projection input 2sbh, dropout mask sbh
               = 11sbh + 5as^2b
    MLP:       input 2sbh, GeLU input 8sbh, second linear input 8sbh, dropout mask sbh = 19sbh
    LayerNorm: 2 x input 2sbh = 4sbh
    total:     sbh(34 + 5as/h)
    tensor parallel, no SP:   sbh(10 + 24/t + 5as/(ht))  (LN inputs, 2 masks and the inputs of the
                              two column-parallel linears (10sbh) stay replicated)
    tensor + sequence par.:   sbh(34/t + 5as/(ht))
    selective recomputation:  the attention term (5as/h) is dropped (recomputed in backward)
    full recomputation:       only the layer input, 2sbh (2sbh/t with SP)

Generalisation used here, with e bytes per activation element (bf16/fp16: 2, fp32: 4), mask
bytes mu (1 for a bool/uint8 mask) and dr = 1 if dropout is on, else 0 (then no mask is saved and
the dropout output *is* its input):

    replicated = (4e + 2*dr*mu) sbh;  split = 12e sbh;  attention = (e + dr*(e + mu)) as^2b
    e = 2, mu = 1, dr = 1 gives 10, 24 and 5 (the paper); fp32 with 1-byte masks: 18, 48, 9,
    i.e. sbh(66 + 9as/h); fp32 without dropout: sbh(64 + 4as/h).

Llama (``norm_saves=2, mlp_saves=4, ffn=F``), counted the same way on zerotron's modules (measured,
tests/test_activations.py): torch's RMSNorm (composite on CPU) saves its input *and* the normalised
tensor (2 tensors of sbh, LayerNorm 1); the SwiGLU MLP saves the gate output (silu input), the silu
output, the up output and their product (down_proj input), 4 tensors of sbF (GELU's MLP: 2 of sbF,
F = 4h); RoPE saves nothing beyond its tables (buffers). Grouped-query attention: zerotron repeats
the H_kv key/value heads to H before SDPA (``models.base.causal_attention``), so the saved k and v
have H heads as in multi-head attention; a GQA-native kernel would save 2(1 - H_kv/H) e sbh/t less.
In general, with n_s tensors per norm and m_s per MLP:

    replicated = ((2 n_s + 2) e + 2 dr mu) sbh;  split = 4e sbh + m_s e sbF
    Llama, fp32, no dropout, F = 3h: 24 sbh replicated + (16 + 48) sbh split.

Measured on this machine (torch 2.13 CPU, ``measure_*`` below, tests/test_activations.py):
* dropout = 0: ``F.scaled_dot_product_attention`` runs the flash-attention CPU kernel: it saves
  q, k, v (views of the one qkv buffer), its output (written in (b, s, a, d) layout, so it is the
  same storage as the c_proj input) and a logsumexp of b*a*s fp32 values; no s^2 term.
  ``attention="flash"`` models that: the paper's count without the attention term (also flash
  attention on GPUs, which regenerates its dropout mask from the RNG instead of storing it).
  ``attention="math"`` is the paper's kernel, and what torch's math backend saves (scaled q and k
  copies, v, the softmax output). Caveat: with micro_batch 1 the math backend saves v as a view of
  the fused qkv output, which keeps all 3sbh alive (+2e*sbh over the estimate, about +10 % here).
* dropout > 0: SDPA falls back to the math kernel, and CPU dropout saves its mask in the
  activation dtype (4 bytes in fp32), not 1 byte: pass ``mask_bytes=4`` to match. CUDA's fused
  dropout keeps a 1-byte bool mask (the default, as in the paper).
* Not counted (small): LayerNorm mean/rstd (2 fp32 values per token per LN: 16*b*s bytes per
  layer), the flash logsumexp (4*b*a*s), token/position ids; together < 1 % for the tiny model.

Autocast (``autocast=True``; zerotron's ``train.dtype = bf16``: fp32 parameters, ``torch.autocast``
to bf16, measured with a dry run's MemTracker and ``saved_tensors_hooks``): only the matmuls (and
SDPA) run in bf16. The residual stream stays fp32 (a bf16 projection output added to an fp32
stream gives fp32), so the norms save fp32 tensors (4 bytes: n_s of them per norm) and a fully
recomputed layer keeps a 4-byte input; and autocast casts the fp32 norm output to bf16 separately
for every Linear that reads it, each saving its own copy: GPT-2's fused c_attn and c_fc 2, Llama's
q, k, v, gate and up 5 (``qkv_linears`` + MLP inputs), where an fp32 model saves one shared norm
output per sub-block. Per layer, bf16 autocast over fp32 parameters (DDP), without dropout:

    replicated = (2 n_s * 4 + (n_qkv + m_s/2) * 2) sbh;  split = 8 sbh + 2 m_s sbF
    GPT-2: 12 sbh replicated + 8 sbh + 4 sbF split (36 sbh at F = 4h; bf16 without autocast 32)
    Llama: 26 sbh replicated + 8 sbh + 8 sbF split (62 sbh at Llama-3-8B's F = 3.5h; 48 without)

Over bf16 compute parameters (``bf16_params``: ZeRO's compute copies, FSDP2's param dtype) the
embedding output, and so the residual stream, is bf16, and a norm's bf16 output feeds its Linears
without a cast (one shared copy per sub-block, as without autocast); but torch's RMSNorm computes
in fp32 and saves two fp32 tensors whatever its input (Llama: 20 sbh replicated, 56 sbh per layer
at Llama-3-8B's shape), where LayerNorm saves its bf16 input (GPT-2: 32 sbh, the bf16 formula).
Autocast also casts every fp32 weight to bf16 once per forward (its weight cache) and the
Linears save those copies until their backward: 2 bytes per matmul weight of the rank and
micro-batch in flight, outside the layer count (``analysis.dryrun.estimate`` adds them).

Outside the layers (Korthikanti section 4.3): the first stage holds the embedding-dropout mask
dr*mu*sbh, the last stage the final LN input and output-layer input 2e*sbh plus the fp32
log-softmax of the cross-entropy, 4*s*b*V/t bytes (vocab-parallel loss; our trainer runs the loss
in fp32, so 4 bytes also for bf16 models). With SP the sbh terms are divided by t.

Pipeline (Korthikanti section 4.2, Narayanan et al. 2021): a rank holds the activations of every
micro-batch whose forward is done and backward is not. The peak comes from the schedule's action
lists and ``simulate(...).peak_in_flight`` (``zerotron.parallel.pipeline.runner.schedules``), each (micro-batch,
chunk) weighted by its stage's layers; 1F1B/interleaved are simulated with at most a few x pp
micro-batches (the occupancy repeats after the warm-up), GPipe is exact in closed form (m).
1F1B's first rank holds pp micro-batches of L/pp layers, i.e. L layers' worth; GPipe holds all m.
With recomputation one layer is re-materialised during its backward: that working set
(layer bytes without recomputation minus with) is added to each rank's peak; with full
recomputation the layer's checkpointed input is one storage with what its first norm saves
(LayerNorm's input, an fp32 stream's RMSNorm input), except where RMSNorm saves an fp32 copy of a
bf16 stream (autocast over bf16 compute parameters): then the input is held beside it (+ r sbh).
What a block's backward allocates beyond its saved tensors: :func:`block_backward_bytes`.
"""
from __future__ import annotations

from functools import lru_cache

from zerotron.analysis.flops import shape_of
from zerotron.models.layout import tp_refusal
from zerotron.plan import CHUNKED_SCHEDULES
from zerotron.stages import Placement

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("math", "flash")
SCHEDULES = ("1f1b", "gpipe", "interleaved", "naive", "zb-h1", "zb-v")
LOSS_BYTES = 4  # fp32 log-softmax output saved by the cross-entropy


def _check(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sp: bool = False, recompute: str = "none", dtype: str = "bf16",
                           dropout: bool = True, attention: str = "math",
                           mask_bytes: int = 1, *, ffn: int | None = None, norm_saves: int = 1,
                           mlp_saves: int = 2, autocast: bool = False, qkv_linears: int = 1,
                           bf16_params: bool = False, norm_fp32: bool = False) -> int:
    """Bytes of activations one transformer layer keeps for backward, per micro-batch, on one
    tensor-parallel rank (formulas in the module docstring; Korthikanti et al. 2022).

    ``dtype``: "bf16" | "fp16" | "fp32" (activation element size); ``recompute``: "none" |
    "selective" | "full"; ``attention``: "math" (explicit softmax, the paper) | "flash" (no s^2
    term); ``dropout``: whether dropout masks are saved; ``mask_bytes``: bytes per mask element
    (1 on CUDA, the activation size for CPU dropout). ``ffn``: MLP width F (None = 4h, GPT-2);
    ``norm_saves``: tensors of sbh one norm saves (LayerNorm 1, torch's RMSNorm 2); ``mlp_saves``:
    tensors of sbF the MLP saves (GELU 2, SwiGLU 4); the defaults are GPT-2's (module docstring).
    ``autocast``: zerotron's bf16 mode (``torch.autocast`` to ``dtype``; module docstring,
    "autocast"). With fp32 parameters (DDP, stage 0) the residual stream and the norms stay fp32 (4
    bytes per saved norm tensor and for the checkpointed layer input) and each column-parallel
    Linear saves its own ``dtype`` cast of its input (``qkv_linears`` for attention -- GPT-2's fused
    c_attn 1, Llama's q/k/v 3 -- plus mlp_saves/2 for the MLP); with ``bf16_params`` (ZeRO's and
    FSDP2's bf16 compute copies) the stream is bf16 and the norm output is shared as without
    autocast. ``norm_fp32``: the norm computes and saves in fp32 whatever its input (torch's RMSNorm
    under autocast; LayerNorm saves its input in the stream's dtype).
    Exact integer arithmetic. Raises ValueError for a non-positive size, an unknown option,
    hidden % heads != 0, or a tp that :func:`zerotron.models.layout.tp_refusal` refuses (heads % tp,
    or sp with seq_len % tp).
    """
    _positive(seq_len=seq_len, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp,
              mask_bytes=mask_bytes)
    _check("recompute", recompute, RECOMPUTE)
    _check("dtype", dtype, DTYPE_BYTES)
    _check("attention", attention, ATTENTION)
    if hidden % heads:
        raise ValueError(f"heads ({heads}) must divide hidden ({hidden})")
    reason = tp_refusal(tp, {"n_head": heads}, seq_len if sp else None, tp_name="tp", seq_name="seq_len",
                        sp_name="sp")
    if reason:
        raise ValueError(reason)
    e, s, b, h, a, t = DTYPE_BYTES[dtype], seq_len, micro_batch, hidden, heads, tp
    dr, mu = int(bool(dropout)), mask_bytes
    sbh, f = s * b * h, 4 * hidden if ffn is None else ffn
    cast = autocast and not bf16_params  # fp32 parameters under autocast: an fp32 stream, casts per Linear
    r = 4 if cast else e  # residual stream bytes
    nb = 4 if autocast and norm_fp32 else r  # bytes of a tensor a norm saves
    if recompute == "full":  # only the layer input is checkpointed
        return r * sbh // t if sp else r * sbh
    inputs = (qkv_linears + mlp_saves // 2) * e if cast else 2 * e  # the column linears' saved inputs
    replicated = (2 * norm_saves * nb + inputs + 2 * dr * mu) * sbh
    split = 4 * e * sbh + mlp_saves * e * s * b * f
    attn = (e + dr * (e + mu)) * a * s * s * b if attention == "math" and recompute == "none" else 0
    if sp:
        return (replicated + split + attn) // t
    return replicated + (split + attn) // t


def layer_small_bytes(shape, seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                      attention: str = "flash", dtype: str = "bf16") -> int:
    """The small tensors one layer saves beside :func:`layer_activation_bytes`' (measured, bf16
    autocast; counted so that the estimate is exact at any size): the flash kernel's logsumexp (4
    bytes per query and local head), the norms' statistics (RMSNorm 1, LayerNorm 2 fp32 values per
    token and norm; / tp with SP) and, with RoPE, the cos/sin tables cast to the activation dtype
    for q and for k (4 tables of seq x head_dim)."""
    s, b = seq_len, micro_batch
    lse = 4 * b * (shape.n_head // tp) * s if attention == "flash" else 0
    stats = 2 * (1 if shape.rms_norm else 2) * 4 * b * s // (tp if sp else 1)
    rope = 0 if shape.learned_positions else 4 * s * shape.head_dim * DTYPE_BYTES[dtype]
    return lse + stats + rope


def loss_backward_bytes(seq_len: int, micro_batch: int, vocab_size: int, tp: int = 1, autocast: bool = False,
                        param_bytes: int = 4, tp_rank: int = 0) -> int:
    """Bytes the cross-entropy's backward allocates at its worst moment beyond the (B, T, V/tp)
    fp32 tensor it saved (``activation_bytes``' LOSS_BYTES term), per micro-batch on the last
    stage, on tensor-parallel rank ``tp_rank`` (measured on zerotron's two loss paths, dry-run
    MemTracker):

    * ``F.cross_entropy`` (tp = 1): nll_loss's gradient and log_softmax's input gradient, two
      (B, T, V) tensors in the loss dtype (fp32; fp64 in fp64) at once: 2 * 4 sbV;
    * the vocab-parallel loss (``parallel.tensor.loss``), shards of v = ceil(V/tp) columns: the
      gradient (softmax - one-hot, in place) 4 sbv, then cast to the logits' dtype (bf16 under
      autocast: 2 sbv more; none in fp32): 6 sbv. Only the rank whose shard holds the padding
      columns (V % tp != 0: the last, with nv = V - (tp-1) v real columns) pads the gradient
      first, the unpadded (4 sb nv) and padded (4 sbv) copies alive together: 4 sb (nv + v), or
      the cast's 6 sbv if larger. The other ranks hold no padded copy (GPT-2-medium's V = 50,257
      at tp 8: the estimate had counted it on every rank, 0.83-0.85 of it traced on the last
      stage's tp rank 0).
    Raises ValueError for a tp_rank outside [0, tp)."""
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank}")
    n = seq_len * micro_batch
    if tp == 1:
        return 2 * max(4, param_bytes) * n * vocab_size
    v = -(-vocab_size // tp)
    nv = max(0, min(v, vocab_size - tp_rank * v))  # real columns of this rank's shard
    cast = 4 * n * v + (2 * n * v if autocast else 0)
    return max(cast, 4 * n * (nv + v)) if nv < v else cast


def block_backward_bytes(shape, seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                         dtype: str = "bf16", autocast: bool = False, bf16_params: bool = False,
                         grad_bytes: int = 0) -> int:
    """Bytes one block's backward holds at its worst moment beyond the block's saved activations
    (:func:`layer_activation_bytes` without recomputation, the recomputed ones with it), per
    micro-batch on one tensor-parallel rank. Measured with a dry run's MemTracker, labelling every
    live storage at the peak by the op, module and pass that made it (issue 33), for the Llama
    block (RMSNorm, SwiGLU) under bf16 autocast over bf16 compute parameters (``bf16_params``:
    ZeRO's compute copies, FSDP2), torch 2.13's CPU kernels; the larger of two moments:

    * the SwiGLU backward (Shazeer 2020): while the gradient of the down projection's input is
      alive, the product's backward makes the gradients of the silu output and of the up
      output (three (b, s, F/t) tensors in the activation dtype), and the product the down
      projection saved is freed: m_s/2 * e * sbF/t net (m_s = 4 saved tensors of sbF);
    * the second RMSNorm's backward: torch's RMSNorm is composite on the CPU (no fused kernel;
      ``aten::_fused_rms_norm`` is CompositeImplicitAutograd in 2.13), and its fp32 backward holds
      five fp32 (b, s, h) temporaries at once (the pow, mean-expand, scalar-mul, product and
      incoming-gradient tensors: 20 sbh bytes, / t with SP), when the MLP's saved tensors (m_s e
      sbF/t), the MLP input (e sbh, gathered under SP), the norm's normalised fp32 tensor (4 sbh)
      and its statistics (4 bytes per token) are already freed.

    ``grad_bytes``: bytes per element of the block's weight gradients when they are held beside
    the model states until the block's backward ends (FSDP2's unsharded gradients in the compute
    dtype, reduce-scattered in the block's post-backward; 0 where the gradient goes into a buffer
    the model states count): the SwiGLU moment then also holds the down projection's (h F/t), the
    norm's all m MLP matrices' (m h F/t) -- which makes the norm moment FSDP2's larger one.

    Llama-3-8B at tp 8 (8,192 tokens): 43,008 bytes per token (the norm), 0.35 GB; at tp 1 the
    SwiGLU moment, 57,344 bytes per token, 0.47 GB. Other modes (an fp32 stream, LayerNorm blocks,
    GELU MLPs) are not modelled: 0."""
    if not (autocast and bf16_params and shape.rms_norm):
        return 0
    e, s, b, h, t = DTYPE_BYTES[dtype], seq_len, micro_batch, shape.n_embd, tp
    d = t if sp else 1
    sbh, sbf, m_s = s * b * h, s * b * shape.ffn // t, 2 * shape.mlp_matrices - 2
    w = h * shape.ffn // t  # one MLP matrix's weights on this tp rank
    mlp = m_s // 2 * e * sbf + grad_bytes * w
    norm = 5 * 4 * sbh // d - (m_s * e * sbf + e * sbh + 4 * sbh // d + 4 * s * b // d) + grad_bytes * shape.mlp_matrices * w
    return max(0, mlp, norm)


def qkv_linears(shape) -> int:
    """Linears computing q, k and v in one block of ``shape``'s family: 1 for GPT-2 (the fused
    ``c_attn``, LayerNorm), 3 for the Llama family (``q_proj``, ``k_proj``, ``v_proj``, RMSNorm)."""
    return 3 if shape.rms_norm else 1


def stage_layer_counts(n_layer: int, n_stages: int) -> list[int]:
    """Balanced layers per model stage, the first ``n_layer % n_stages`` stages one extra (as
    ``zerotron.parallel.pipeline.executor.stage_layer_counts`` without pp_split). Raises ValueError if
    n_stages < 1 or n_stages > n_layer."""
    _positive(n_layer=n_layer, n_stages=n_stages)
    if n_stages > n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_stages} pipeline stages "
                         f"(pp * virtual_stages must be <= n_layer)")
    q, r = divmod(n_layer, n_stages)
    return [q + (i < r) for i in range(n_stages)]


def looped_counts(counts: list[int], pp: int, kind: str) -> list[int]:
    """Layer counts of the model stages re-indexed as ``chunk * pp + rank`` (the looped placement
    the estimators index by): unchanged for every kind but zb-v, whose rank r holds model stages r
    and 2pp-1-r (the V of ``zerotron.stages.Placement``), so its second half is reversed."""
    place = Placement.for_schedule(pp, kind, len(counts) // pp)
    loop, out = Placement(pp, place.v), [0] * len(counts)
    for s, c in enumerate(counts):
        r = place.rank_of(s)
        out[loop.stage_of(r, place.stages(r).index(s))] = c
    return out


@lru_cache(maxsize=512)
def _in_flight_states(pp: int, microbatches: int, kind: str, v: int) -> tuple:
    """The schedule's activation occupancy, cached per shape: (peak in-flight (micro-batch,
    chunk) units per rank, per rank the set of states seen right after each F and each B, a state
    being the units held per chunk, then per chunk those whose B is done and W pending). A unit's activations are held from
    its F until its backward ends: the fused B, or, when the backward is split (zb-h1, zb-v), its
    W -- ``split_backward.backward_input`` runs B with ``retain_graph=True``, so every saved tensor
    stays until W frees the graph -- and between B and W the gradients captured for W are held
    too (the "pending" count). ``peak_in_flight`` equals ``simulate(...).peak_in_flight``
    (tested)."""
    from zerotron.parallel.pipeline.schedules import build_schedule

    sched = build_schedule(pp, microbatches, kind, v)
    peaks, states = [], []
    for actions in sched:
        split = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
        live, pend, seen, peak = [0] * v, [0] * v, set(), 0
        for a in actions:
            c = a.chunk
            if a.kind == "F":
                live[c] += 1
            elif a.kind == "B" and (a.microbatch, c) in split:
                pend[c] += 1
            elif a.kind in ("B", "W"):
                live[c] -= 1
                pend[c] -= a.kind == "W"
            else:
                continue
            peak = max(peak, sum(live))
            if a.kind in ("F", "B"):
                seen.add((*live, *pend))
        peaks.append(peak)
        states.append(frozenset(seen))
    return tuple(peaks), tuple(states)


def _cap(pp: int, m: int, kind: str, v: int) -> int:
    """Micro-batches enough to reach the steady-state occupancy (1F1B and ZB-H1 warm-up <= pp - 1
    forwards, interleaved <= (v + 1) pp; a multiple of pp for interleaved; ZB-V's list schedule
    within 3 pp); checked against uncapped runs in tests/test_activations.py."""
    if kind == "interleaved" and m % pp == 0:
        return min(m, pp * (v + 2))
    return min(m, 2 * pp) if kind in ("1f1b", "zb-h1") else min(m, 3 * pp) if kind == "zb-v" else m


def wgrad_layer_bytes(seq_len: int, micro_batch: int, shape, tp: int = 1, sp: bool = False,
                      dtype: str = "bf16") -> int:
    """Bytes one layer holds between B and W of a split backward (zb-h1, zb-v), per micro-batch on
    one tp rank, beyond its activations: the gradients ``split_backward.backward_input`` captures
    at the output of every op that has weights, for W to resume from: the two norms (sbh each, /t
    with SP), the column-parallel q/k/v (s b (h + 2 H_kv D)/t) and MLP-in (GELU's fc s b F/t,
    SwiGLU's gate and up 2 s b F/t) matmuls, and the row-parallel attention-out and MLP-out matmuls
    (sbh each: their partial sums before the tp reduction), in the activation dtype."""
    s = shape
    sbh, t = seq_len * micro_batch * s.n_embd, tp
    e = DTYPE_BYTES[dtype]
    col = seq_len * micro_batch * (s.n_embd + 2 * s.kv_dim + (s.mlp_matrices - 1) * s.ffn) // t
    return e * ((2 * sbh // t if sp else 2 * sbh) + 2 * sbh + col)


def activation_bytes(cfg, micro_batch: int, seq_len: int, tp: int = 1, sp: bool = False,
                     pp: int = 1, schedule: str = "1f1b", microbatches: int = 1,
                     virtual_stages: int = 1, recompute: str = "none", dtype: str = "bf16",
                     attention: str = "math", dropout: bool | None = None,
                     mask_bytes: int = 1, layer_counts: list[int] | None = None,
                     autocast: bool = False, bf16_params: bool = False) -> dict:
    """Activation bytes per pipeline rank of the model of ``cfg`` (a ``GPTConfig``,
    ``LlamaConfig`` or :class:`zerotron.analysis.flops.Shape`) for one training step; the layer
    count of its family (module docstring: Llama's RMSNorm, SwiGLU; no embedding dropout in Llama).

    ``microbatches`` per pipeline flush; ``schedule`` "1f1b" | "gpipe" | "interleaved" (with
    ``virtual_stages`` >= 2) | "naive" | "zb-h1" | "zb-v" (``virtual_stages`` = 2, the V placement:
    :func:`looped_counts`); with pp == 1 and a one-chunk schedule the micro-batches run
    forward+backward one after the other (1 in flight). Zero-bubble schedules hold a unit's
    activations until its W, and between its B and W the captured gradients of
    :func:`wgrad_layer_bytes` (plus, on the last stage, the logits' gradient); the peak is the
    largest per-rank state of the schedule's action lists. ``dropout`` None = ``cfg.dropout > 0``.
    ``layer_counts``: layers per model stage (pp * v counts, e.g. the runner's balanced split of
    ``parallel.pp_split = auto``); None = :func:`stage_layer_counts` (even). ``autocast`` and
    ``bf16_params``: zerotron's bf16 mode over fp32 or bf16 compute parameters (see
    :func:`layer_activation_bytes`; likewise for the final norm and the head's input).
    Other options as in :func:`layer_activation_bytes`.

    Returns ``{"per_layer_bytes", "layers_per_stage", "embedding_bytes" (stage 0, per micro-batch),
    "output_bytes" (last stage, per micro-batch, incl. the loss), "wgrad_bytes" (per model stage and
    micro-batch between B and W; zeros without a split backward), "recompute_workspace_bytes",
    "peak_in_flight" (micro-batch x chunk units per rank), "per_rank_bytes", "max_bytes",
    "worst_rank"}``, bytes on one tensor-parallel rank. Raises ValueError for bad sizes/options,
    seq_len > block_size, pp*v > n_layer or a schedule that ``build_schedule`` rejects.
    """
    _positive(pp=pp, microbatches=microbatches, virtual_stages=virtual_stages)
    _check("schedule", schedule, SCHEDULES)
    if seq_len > getattr(cfg, "block_size", seq_len):
        raise ValueError(f"seq_len ({seq_len}) exceeds the model's block_size ({cfg.block_size})")
    shape = cfg if hasattr(cfg, "block_params") else shape_of(cfg)
    reason = tp_refusal(tp, shape.tp_sizes(), seq_len if sp else None, tp_name="tp", seq_name="seq_len", sp_name="sp")
    if reason:
        raise ValueError(reason)
    dropout = shape.dropout > 0 if dropout is None else dropout
    ns = 2 if shape.rms_norm else 1
    args = dict(tp=tp, sp=sp, dtype=dtype, dropout=dropout, attention=attention,
                mask_bytes=mask_bytes, ffn=shape.ffn, norm_saves=ns, mlp_saves=2 * shape.mlp_matrices - 2,
                autocast=autocast, qkv_linears=qkv_linears(shape), bf16_params=bf16_params,
                norm_fp32=shape.rms_norm)
    h, t, e = shape.n_embd, tp, DTYPE_BYTES.get(dtype, 0)
    small = 0 if not autocast else layer_small_bytes(shape, seq_len, micro_batch, tp, sp, attention, dtype)
    per_layer = layer_activation_bytes(seq_len, micro_batch, h, shape.n_head, recompute=recompute,
                                       **args) + (small if recompute != "full" else 0)
    workspace = layer_activation_bytes(seq_len, micro_batch, h, shape.n_head, **args) + small - per_layer
    if recompute == "full" and autocast and bf16_params and shape.rms_norm:
        workspace += per_layer  # the checkpointed bf16 input beside the norm's own fp32 copy of it
    v = virtual_stages if schedule in CHUNKED_SCHEDULES else 1
    counts = list(layer_counts) if layer_counts is not None else stage_layer_counts(shape.n_layer, pp * v)
    if len(counts) != pp * v or sum(counts) != shape.n_layer:
        raise ValueError(f"layer_counts {counts} must be {pp * v} counts summing to n_layer ({shape.n_layer})")
    sbh = seq_len * micro_batch * h
    div = t if sp else 1
    emb = int(dropout and shape.learned_positions) * mask_bytes * sbh // div  # GPT-2's embedding dropout
    nb = 4 if autocast and (shape.rms_norm or not bf16_params) else e  # a final-norm saved tensor
    norm_out = ns * nb + e  # final norm's saves + the head's input (its cast, or the shared norm output)
    out = norm_out * sbh // div + LOSS_BYTES * seq_len * micro_batch * -(-shape.vocab_size // t)
    last = len(counts) - 1
    unit = [c * per_layer + (emb if s == 0 else 0) + (out if s == last else 0) for s, c in enumerate(counts)]
    split = schedule in ("zb-h1", "zb-v")
    wlayer = wgrad_layer_bytes(seq_len, micro_batch, shape, tp, sp, dtype) if split else 0
    wunit = [c * wlayer + (e * seq_len * micro_batch * -(-shape.vocab_size // t) if split and s == last else 0)
             for s, c in enumerate(counts)]
    unit, wunit_l = looped_counts(unit, pp, schedule), looped_counts(wunit, pp, schedule)
    if pp == 1 and v == 1:  # plain gradient accumulation: forward+backward per micro-batch
        peaks, states = (1,), (frozenset({(1, 0)}),)
    elif schedule == "gpipe":  # all forwards, then all backwards: every rank holds m
        peaks, states = (microbatches,) * pp, (frozenset({(microbatches, 0)}),) * pp
    else:  # occupancy repeats after the warm-up: walk at most _cap micro-batches
        peaks, states = _in_flight_states(pp, _cap(pp, microbatches, schedule, v), schedule, v)
    per_rank = [max(sum(n * unit[c * pp + r] + k * wunit_l[c * pp + r] for c, (n, k) in enumerate(zip(st[:v], st[v:])))
                    for st in states[r]) + workspace for r in range(pp)]
    worst = max(range(pp), key=lambda r: (per_rank[r], -r))
    return {"per_layer_bytes": per_layer, "layers_per_stage": counts, "embedding_bytes": emb,
            "output_bytes": out, "wgrad_bytes": wunit, "recompute_workspace_bytes": workspace,
            "peak_in_flight": list(peaks), "per_rank_bytes": per_rank,
            "max_bytes": per_rank[worst], "worst_rank": worst}


def _measure(model, idx, targets=None) -> dict:
    import torch

    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_storages |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    blocks = list(model.blocks() if hasattr(model, "blocks") else model.transformer.h)
    where = {"layer": None}
    seen: set = set()
    layer_bytes = [0] * len(blocks)
    other = [0]

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in param_storages:
            seen.add(key)
            if where["layer"] is None:
                other[0] += storage.nbytes()
            else:
                layer_bytes[where["layer"]] += storage.nbytes()
        return t

    def enter(i):
        return lambda module, inputs: where.__setitem__("layer", i)

    handles = [blk.register_forward_pre_hook(enter(i)) for i, blk in enumerate(blocks)]
    handles += [blk.register_forward_hook(lambda m, i, o: where.__setitem__("layer", None))
                for blk in blocks]
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(idx)
            if targets is not None:
                from zerotron.parallel.base import token_loss_sum

                out = token_loss_sum(out, targets)
            total = sum(layer_bytes) + other[0]  # measured while the graph (and storages) live
    finally:
        for hd in handles:
            hd.remove()
    del out
    return {"total_bytes": total, "layer_bytes": layer_bytes, "other_bytes": other[0]}


def measure_activation_bytes(model, idx, targets=None) -> int:
    """Bytes of the tensors autograd saves for backward in one forward of a plain model (GPT, Llama)
    on token ids ``idx`` (B, T) (plus the cross-entropy of ``zerotron.parallel.base.token_loss_sum``
    when ``targets`` is given), counted through ``torch.autograd.graph.saved_tensors_hooks``.

    Each storage counts once (q, k, v are views of one qkv buffer; a saved op output and its views
    share storage); parameters, buffers and views of them are not activations and are excluded. The
    model's train/eval mode is used as is (dropout masks only in train mode). Raises what the
    model's forward raises for a bad ``idx``."""
    return _measure(model, idx, targets)["total_bytes"]


def measure_layer_activation_bytes(model, idx) -> list[int]:
    """Like :func:`measure_activation_bytes`, split per transformer block: entry i is the bytes of
    storages first saved while block i ran forward (its input included; embedding and head excluded)."""
    return _measure(model, idx)["layer_bytes"]
