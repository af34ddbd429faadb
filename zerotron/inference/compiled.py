"""Compiled decoding with static shapes (``--compile`` of ``generate``, ``bench generate``, ``serve
--batching window``): :class:`CompiledDecoder`, :class:`BucketKVCache`.

One decode step (every row's last token through the embedding, all blocks with their KV cache,
the head) is one ``torch.compile`` call (``fullgraph=True``: a single graph, no break; Ansel et
al. 2024, "PyTorch 2"), so a token costs one compiled call instead of a few hundred eager kernel
launches. Static shapes (``dynamic=False``, nothing marked dynamic): the compiled step sees only
tensors of fixed shapes, so a shape compiles once and every later step of that shape reuses it.
Two things vary while decoding and are made static here:

* **the batch**: rows are padded to a *batch bucket*, the smallest power of two >= the rows
  (1, 2, 4, 8, 16, 32, ...); padding rows decode token ``PAD_ID`` at position 0 and are ignored.
  When rows finish and leave, the survivors move to the bucket of their count (a copy of their
  cache);
* **the cache length**: each layer's keys and values live in a buffer (bucket, H_kv, C, D) whose
  capacity C is the *length bucket* of what the batch needs (padded prompt + the most new tokens a
  row still wants, capped at ``block_size``, as :class:`~zerotron.inference.kvcache.StaticKVCache`
  sizes it): the smallest power of two >= that need, at least 16, at most ``block_size``. Attention
  reads all C slots and masks the unwritten ones.

Each (batch bucket, length bucket) pair compiles once per process and model (the first batch of
that shape: its warm-up); any prompt lengths and batch sizes that fall in already-compiled buckets
compile nothing more (``zerotron.parallel.compile.compile_stats`` stays flat; the tests assert
it). The prefill (the prompt, whose length varies) runs eagerly into a
:class:`~zerotron.inference.kvcache.StaticKVCache`, then is moved into the bucket buffers; a batch
whose context passes ``block_size`` is re-prefilled eagerly as in :mod:`zerotron.inference.batch`.

The slot layout makes a fixed-size buffer look like the left-padded cache the models already
attend to: a row's token at position p sits in slot ``C - 1 - p`` (newest first, read backwards).
The row's valid keys are then always the *suffix* of slots ``C - 1 - n .. C - 1`` (n = the new
token's position), so the step hands the models' attention ``pad = C - 1 - n`` per row, and the
single query (T = 1) of ``models.base.causal_attention`` sees exactly the keys >= pad: no model
change. Keys are permuted relative to the eager cache, which only changes the order of the
softmax-weighted sums (rounding; greedy tokens equal, tested in fp64 and fp32). Positions (learned
embeddings, RoPE) come from ``positions()`` (each row's own n), as in the padded eager batch.

On CUDA the step compiles with ``mode="reduce-overhead"`` (CUDA graphs: a step is one graph
replay) and the KV buffers are marked static addresses (``torch._dynamo.mark_static_address``),
since the graph writes them in place; buffers are kept per bucket and reused across batches so
their addresses stay fixed. On CPU Inductor emits C++/OpenMP kernels (mode default).

Layouts: the single process and data parallel (each replica decodes its own rows). Tensor and
pipeline parallelism (collectives inside the step) and expert parallelism are refused with the
reason by :class:`~zerotron.inference.Engine`; the paged continuous-batching engine
(``serve --batching continuous``) runs eagerly (its step gathers through per-row block tables).
"""
from __future__ import annotations

import torch

from zerotron.models.base import KVCache

from .forward import forward_layers
from .kvcache import StaticKVCache

__all__ = ["CompiledDecoder", "BucketKVCache", "batch_bucket", "length_bucket", "MIN_LENGTH_BUCKET",
           "compile_refusal"]

MIN_LENGTH_BUCKET = 16  # the smallest KV capacity a compiled step is built for


def batch_bucket(rows: int) -> int:
    """The batch size a compiled step runs ``rows`` (>= 1) rows at: the smallest power of two >= rows."""
    b = 1
    while b < rows:
        b *= 2
    return b


def length_bucket(need: int, block_size: int) -> int:
    """The KV capacity (slots) for a batch that needs ``need`` (1 .. block_size) slots: the
    smallest power of two >= max(need, 16), capped at ``block_size``."""
    c = MIN_LENGTH_BUCKET
    while c < need:
        c *= 2
    return min(c, block_size)


def compile_refusal(tp: int, pp: int, ep: int) -> str:
    """The one-line reason compiled decoding cannot run on this layout, or "" when it can."""
    if tp > 1 or pp > 1 or ep > 1:
        return (f"--compile (compiled decoding) runs the single process and data parallel only, got tp={tp}, "
                f"pp={pp}, ep={ep}: collectives inside the decode step would split it; drop --compile or "
                "the model-parallel degrees")
    return ""


class _SlotView(KVCache):
    """The cache one compiled step sees (built inside the traced function from tensors only):
    layer buffers ``keys[i]``/``values[i]`` (Bb, H_kv, C, D), the new token's position ``pos``
    (Bb,) int64 per row, written at slot C - 1 - pos; ``pad`` = C - 1 - pos masks every slot
    before it (the unwritten ones: positions past the row's)."""

    def __init__(self, keys, values, pos):
        self.keys, self.values, self.pos = keys, values, pos
        self.pad = (keys[0].size(2) - 1) - pos
        self.slot = self.pad.view(-1, 1, 1, 1)

    def cached(self, layer: int) -> int:
        return 0  # never a Python int that changes per step (that would be a guard: a recompile)

    def positions(self, T: int, layer: int) -> torch.Tensor:
        return self.pos[:, None]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.keys[layer].scatter_(2, self.slot.expand(k.shape), k)
        self.values[layer].scatter_(2, self.slot.expand(v.shape), v)
        return self.keys[layer], self.values[layer]


def _decode_step(model, blocks, layers, tokens, pos, keys, values):
    """tokens (Bb, 1), pos (Bb,) -> last-position logits (Bb, V); writes the new keys/values."""
    return forward_layers(model, blocks, layers, tokens, _SlotView(keys, values, pos), True, True)


_compiled: dict = {}


def _entry(mode: str | None):
    if mode not in _compiled:
        import torch._dynamo.config
        # as train.compile (zerotron.parallel.compile): never silently eager past the recompile limit
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled[mode] = torch.compile(_decode_step, mode=mode, dynamic=False, fullgraph=True)
    return _compiled[mode]


class BucketKVCache(KVCache):
    """A batch's KV cache in bucket buffers (see the module notes), standing in for the
    :class:`StaticKVCache` of a :class:`~zerotron.inference.batch.DecodeBatch` after its prefill.
    ``S``: slots of the equivalent left-padded cache (``cached()``, what the batch's context rule
    reads), ``pad`` (B,): its left padding, so row b's next token is at position S - pad[b];
    ``B``: real rows (the first B of the bucket). Built by :meth:`CompiledDecoder.adopt`."""

    def __init__(self, decoder: "CompiledDecoder", static: StaticKVCache, block_size: int):
        held = [i for i, k in enumerate(static.keys) if k is not None]
        k0 = static.keys[held[0]]
        self.decoder, self.B, self.S = decoder, k0.size(0), static.lengths[held[0]]
        self.pad = static.pad if static.pad is not None else torch.zeros(self.B, dtype=torch.long, device=k0.device)
        self.C = length_bucket(static.capacity, block_size)
        self.keys, self.values = decoder.buffers(static, batch_bucket(self.B), self.C)
        # slot s of row b holds position C-1-s = eager slot pad[b] + C-1-s (clamped: masked, finite)
        s = torch.arange(self.C, device=k0.device)
        src = (self.pad[:, None] + (self.C - 1) - s[None, :]).clamp_(0, self.S - 1)  # (B, C)
        for i in held:
            for dst, old in ((self.keys[i], static.keys[i]), (self.values[i], static.values[i])):
                b, h, _, d = old.shape
                dst[:b].copy_(old[:, :, :self.S].gather(2, src[:, None, :, None].expand(b, h, self.C, d)))

    def cached(self, layer: int) -> int:
        return self.S

    def keep_rows(self, idx: torch.Tensor) -> None:
        """Keep rows ``idx`` (in that order); they move to the bucket of their count."""
        n = idx.numel()
        bb = batch_bucket(n)
        if bb != self.keys[next(i for i, k in enumerate(self.keys) if k is not None)].size(0):
            keys, values = self.decoder.buffers(self, bb, self.C)
        else:
            keys, values = self.keys, self.values
        for src, dst in ((self.keys, keys), (self.values, values)):
            for i, t in enumerate(src):
                if t is not None:
                    dst[i][:n].copy_(t.index_select(0, idx))
        self.keys, self.values = keys, values
        self.pad, self.B = self.pad.index_select(0, idx), n

    def decode(self, model, blocks, layers, tokens: torch.Tensor) -> torch.Tensor:
        """One compiled step of the B real rows' last tokens (B, 1) -> logits (B, V)."""
        bb = self.keys[layers[0]].size(0)
        x = torch.zeros(bb, 1, dtype=tokens.dtype, device=tokens.device)  # padding rows: token 0 at position 0
        x[:self.B] = tokens
        pos = torch.zeros(bb, dtype=torch.long, device=tokens.device)
        pos[:self.B] = self.S - self.pad
        logits = self.decoder.fn(model, blocks, layers, x, pos, self.keys, self.values)
        self.S += 1
        return logits[:self.B]


class CompiledDecoder:
    """Compiled decode steps for one model (the dense model of a single-process or data-parallel
    :class:`~zerotron.inference.Engine`) on ``device``: CUDA uses ``mode="reduce-overhead"``
    (CUDA graphs), CPU Inductor's default. Keeps one set of KV buffers per (batch bucket, length
    bucket), zeroed at creation (stale slots of earlier batches stay finite and are masked)."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.fn = _entry("reduce-overhead" if device.type == "cuda" else None)
        self.blocks = model.blocks()
        self.layers = list(range(model.config.n_layer))
        self._buffers: dict = {}

    def buffers(self, like, rows: int, capacity: int):
        """The (keys, values) layer lists of bucket (rows, capacity), shaped after ``like``'s layers."""
        key = (rows, capacity)
        if key not in self._buffers:
            keys, values = [None] * len(like.keys), [None] * len(like.values)
            for i, (k, v) in enumerate(zip(like.keys, like.values)):
                if k is None:
                    continue
                keys[i] = k.new_zeros(rows, k.size(1), capacity, k.size(3))
                values[i] = v.new_zeros(rows, v.size(1), capacity, v.size(3))
                if self.device.type == "cuda":  # written in place by the CUDA graph: a fixed address
                    torch._dynamo.mark_static_address(keys[i])
                    torch._dynamo.mark_static_address(values[i])
            self._buffers[key] = (keys, values)
        return self._buffers[key]

    def step(self, batch, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of ``batch`` (a :class:`~zerotron.inference.batch.DecodeBatch` whose cache
        was just prefilled or is already in bucket buffers) on its last tokens (B, 1): logits (B, V)."""
        if not isinstance(batch.cache, BucketKVCache):
            batch.cache = BucketKVCache(self, batch.cache, batch.block_size)
        return batch.cache.decode(self.model, self.blocks, self.layers, tokens)
