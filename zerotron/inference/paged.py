"""A paged KV cache (PagedAttention, Kwon et al., SOSP 2023): :class:`BlockAllocator` (the
bookkeeping: free list, reference counts, prefix cache) and :class:`BlockPool` (the tensors: one
preallocated pool of fixed-size blocks per layer) with :class:`PagedView` (one forward's
``KVCache`` reading through the rows' block tables).

Each sequence owns a *block table*: the ids of the blocks holding its keys/values in order, block
j holding the sequence's slots ``j * page .. (j + 1) * page - 1``. A sequence only ever appends, so
only its last block can be partly filled; a block shared by several tables (reference count > 1)
is copied before it is written (copy-on-write), which is how ``n > 1`` samples of one prompt
share the prompt's blocks.

Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention, Zheng et al. 2024, keeps
the same reuse in a radix tree): a *full* block is keyed by ``hash((key of the block before it,
its page tokens))``, so equal keys mean equal tokens from slot 0 on, hence equal keys and values.
A new sequence takes the cached blocks of its longest matching run of full blocks (reference count
+1); a block whose count drops to 0 keeps its key and stays reusable, on a least-recently-used
list, until the allocator needs its storage.

The allocator is plain Python and deterministic: every rank keeps the same bookkeeping (for every
dp replica), so rank 0's scheduling decisions are every rank's without a message.
"""
from __future__ import annotations

import collections

import torch

__all__ = ["BlockAllocator", "BlockPool", "PagedView", "OutOfBlocks", "blocks_for_budget"]


class OutOfBlocks(RuntimeError):
    """No free block and no unreferenced cached block to evict."""


class BlockAllocator:
    """Block ids 0 .. ``num_blocks`` - 1 of ``page`` slots each. ``free``: ids never used or
    released without a prefix key (a deque, taken from the left); ``lru``: unreferenced blocks that
    still carry a prefix key (oldest first; evicted when ``free`` is empty). Counters:
    ``hits``/``misses`` (full prompt blocks found / not found in the prefix cache),
    ``evictions``. Raises ValueError for num_blocks < 1 or page < 1."""

    def __init__(self, num_blocks: int, page: int, prefix_caching: bool = True):
        if num_blocks < 1 or page < 1:
            raise ValueError(f"need num_blocks >= 1 and page >= 1, got {num_blocks}, {page}")
        self.num_blocks, self.page, self.prefix_caching = num_blocks, page, prefix_caching
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # prefix key -> block id
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hits = self.misses = self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks that :meth:`allocate` can hand out now (free + evictable)."""
        return len(self.free) + len(self.lru)

    @property
    def used(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.available

    def allocate(self) -> int:
        """A block id with reference count 1 (a free one, else the least recently used cached
        one, whose key is dropped). Raises :class:`OutOfBlocks`."""
        if self.free:
            b = self.free.popleft()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            del self.cached[self.key[b]]
            self.key[b] = None
            self.evictions += 1
        else:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        self.refs[b] = 1
        return b

    def share(self, b: int) -> int:
        """One more reference to block ``b`` (a fork, or a prefix-cache hit); returns b."""
        if self.refs[b] == 0:
            self.lru.pop(b, None)
        self.refs[b] += 1
        return b

    def release(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table``; unreferenced blocks become free (or,
        with a prefix key, most recently used evictable)."""
        for b in reversed(table):  # the tail first: it is the least likely to be shared again
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.key[b] is not None:
                    self.lru[b] = None
                else:
                    self.free.append(b)

    @staticmethod
    def chain(prev: int | None, tokens) -> int:
        """The prefix key of a full block of ``tokens`` after the block whose key is ``prev``."""
        return hash((prev, tuple(tokens)))

    def prefix_keys(self, tokens: list[int], limit: int) -> list[int]:
        """The prefix keys of the full blocks of ``tokens[:limit]`` (empty without prefix caching)."""
        if not self.prefix_caching:
            return []
        out, prev, p = [], None, self.page
        for j in range(limit // p):
            prev = self.chain(prev, tokens[j * p:(j + 1) * p])
            out.append(prev)
        return out

    def match(self, tokens: list[int], limit: int, keys: list[int] | None = None) -> list[int]:
        """The cached blocks of the longest run of full blocks of ``tokens`` (covering at most
        ``limit`` tokens) with a prefix-cache entry; each gets a reference; hits/misses count the
        full blocks of ``tokens[:limit]`` found / not found. ``keys``: their :meth:`prefix_keys`,
        if computed already."""
        if not self.prefix_caching:
            return []
        out, prev, p = [], None, self.page
        for j in range(limit // p):
            prev = keys[j] if keys is not None else self.chain(prev, tokens[j * p:(j + 1) * p])
            b = self.cached.get(prev)
            if b is None:
                self.misses += limit // p - j
                break
            out.append(self.share(b))
            self.hits += 1
        return out

    def register(self, table: list[int], tokens: list[int], start: int, end: int, keys: list[int] | None = None,
                 base: int = 0) -> None:
        """The blocks of ``table`` that became full while slots ``start`` .. ``end`` - 1 were
        written (slot s holds ``tokens[base + s]``) get their prefix keys (a block already cached
        under the same key keeps the entry). ``keys``: the prefix keys of the sequence's first
        full blocks, computed by earlier calls (a sequence only appends, so they stay valid) and
        extended here in place; then a call hashes only the blocks that became full (O(new
        tokens)), else every full block from slot 0 (O(end))."""
        if not self.prefix_caching:
            return
        p = self.page
        keys = [] if keys is None else keys
        j0 = min(start // p, len(keys))  # the first block that may have become full
        prev = keys[j0 - 1] if j0 else None
        for j in range(j0, end // p):
            if j < len(keys):
                prev = keys[j]
            else:
                prev = self.chain(prev, tokens[base + j * p:base + (j + 1) * p])
                keys.append(prev)
            if (j + 1) * p <= start:
                continue
            b = table[j]
            if self.key[b] is None and prev not in self.cached:
                self.key[b], self.cached[prev] = prev, b


def blocks_for_budget(budget_bytes: int, page: int, layers: int, kv_heads: int, head_dim: int,
                      elem_bytes: int) -> int:
    """Blocks of ``page`` slots that ``budget_bytes`` hold on a rank with ``layers`` layers of
    ``kv_heads`` local key/value heads of ``head_dim`` (keys and values, ``elem_bytes`` each)."""
    return budget_bytes // (2 * page * layers * kv_heads * head_dim * elem_bytes)


class BlockPool:
    """The tensors of a paged cache on this rank: per layer ``keys[i]``/``values[i]``
    (H_kv, num_blocks * page, D) (H_kv: this rank's kv heads; allocated, zeroed, at the layer's
    first write: the shape comes from the model), for the layers this rank holds. Heads outermost:
    a gather through the block tables then gives each (row, head) its S keys contiguously, the
    layout attention reads fastest (about twice as fast as heads interleaved, measured on CPU)."""

    def __init__(self, n_layer: int, num_blocks: int, page: int):
        self.num_blocks, self.page = num_blocks, page
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None

    def scratch(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of at least ``n`` elements of ``like``'s dtype and device, reused by
        every layer's gather (:meth:`PagedView.update`): grown (by half at least) when a forward
        needs more, never shrunk (at most the largest forward's keys and values of one layer, (B, H_kv, S, D) each).
        A fresh tensor per gather cost about 3x the gather's CPU on this machine (its pages
        faulted in anew each time: 10.6 vs 3.4 ms at 64 rows x 200 slots, 38 vs 11 ms at 660)."""
        s = self._scratch
        if s is None or s[0].dtype != like.dtype or s[0].device != like.device:
            s = self._scratch = (like.new_empty(n), like.new_empty(n))
        elif s[0].numel() < n:  # grown by half at least: contexts grow a slot per step, a new buffer each time
            m = max(n, s[0].numel() * 3 // 2)  # faulted its pages in anew (measured: 8 % of the step at 64 rows)
            s = self._scratch = (like.new_empty(m), like.new_empty(m))
        return s

    def nbytes(self) -> int:
        """Bytes allocated so far."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values if t is not None)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block ``dst`` gets block ``src``'s keys and values in every layer."""
        p = self.page
        for t in self.keys + self.values:
            if t is not None:
                t[:, dst * p:(dst + 1) * p].copy_(t[:, src * p:(src + 1) * p])


class PagedView:
    """One forward's ``KVCache`` over ``pool`` for rows b = 0 .. B-1 with block tables
    ``tables[b]`` (covering the slots to be written), ``lens[b]`` slots cached before, and
    ``news[b]`` new tokens right-aligned in the forward's T input slots (T = max news; the first
    T - news[b] inputs of row b are padding).

    The model sees the usual left-padded ``KVCache``: the keys of row b are its lens[b] + news[b]
    slots gathered through its block table (:meth:`update` returns (B, H_kv, S, D) with
    S = cached + T, cached = max(lens - (T - news))), right-aligned with ``pad[b]`` leading slots
    masked by attention; positions ``slot - pad`` are each row's own (lens[b] onward).

    ``share_prefix`` (and B > 1): the leading blocks that every row's table starts with, full and
    cached before this forward (``prefix_blocks`` of them, P = prefix_blocks * page slots: a shared
    system prompt, forks of one prompt), are split off: :meth:`update` then returns each row's keys
    *after* the prefix (S = cached + T counted from slot P; ``pad`` and ``cached`` likewise) and
    leaves the prefix's keys and values of the layer in ``prefix`` ((H_kv, P, D) each, read once,
    a view of the pool when the blocks are consecutive), for
    :class:`~zerotron.inference.prefix_attention.SharedPrefixHooks` to attend to once for all
    rows; positions stay the rows' own. ``prefix`` is None without a shared prefix."""

    def __init__(self, pool: BlockPool, tables: list[list[int]], lens: list[int], news: list[int], device,
                 share_prefix: bool = False):
        self.pool, p = pool, pool.page
        T = max(news)
        width = max(len(t) for t in tables)
        # one (B, width) block table (short rows padded with block 0, never read) and the slot
        # arithmetic as tensor ops: O(B * blocks) Python, not O(B * slots)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        m = 0
        if share_prefix and len(tables) > 1:
            lim = min(lens) // p  # blocks full and cached in every row
            first = tables[0][0] if lim else None
            if lim and all(t[0] == first for t in tables):  # else no common prefix: no tensor ops (a sync) per step
                same = (table[:, :lim] == table[:1, :lim]).all(0)
                m = int(same.long().cumprod(0).sum())  # leading blocks equal in every row
        self.prefix_blocks, self.prefix, P = m, None, m * p
        self.memo: dict = {}  # per-forward values the attention hooks compute once (masks)
        self._prefix_idx = self._prefix_span = None
        if m:
            first = table[0, :m]
            if bool((first[1:] - first[:-1] == 1).all()):  # consecutive blocks: the pool's slots as a view
                self._prefix_span = (int(first[0]) * p, int(first[0]) * p + P)
            else:
                self._prefix_idx = (first[:, None] * p + torch.arange(p, device=device)).view(-1)
            table = table[:, m:]
        self.S0 = max(n - P - (T - k) for n, k in zip(lens, news))
        S = self.S0 + T
        L = torch.tensor(lens, dtype=torch.long, device=device) - P
        M = torch.tensor(news, dtype=torch.long, device=device)
        self.P = P
        self.pad = self.S0 - L + (T - M)  # (B,) leading padding slots per row
        # column j of row b holds the row's slot P + j - pad[b]; padding reads the row's slot P
        # (masked by attention, finite)
        s = (torch.arange(S, device=device)[None, :] - self.pad[:, None]).clamp_(min=0)  # (B, S)
        self.gather = table.gather(1, s // p) * p + s % p  # (B, S) pool slots
        self.all_real = min(news) == T
        self.real = torch.arange(T, device=device)[None, :] >= (T - M)[:, None]  # (B, T) new, not padding
        g = self.gather[:, self.S0:]
        self.dst = g.reshape(-1) if self.all_real else g[self.real]  # pool slots of the real new tokens, row-major

    def cached(self, layer: int) -> int:
        return self.S0

    def positions(self, T: int, layer: int) -> torch.Tensor:
        pos = torch.arange(self.S0 + self.P, self.S0 + self.P + T, device=self.pad.device)[None, :] - self.pad[:, None]
        return pos.clamp_(min=0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write the real new slots of k, v (B, H_kv, T, D) into their blocks; return every row's
        keys and values gathered through its table, (B, H_kv, S, D): views of the pool's scratch
        buffers (:meth:`BlockPool.scratch`), valid until the next ``update`` (the next layer), as
        attention reads them at once. With a shared prefix: the rows' keys after it, and the
        prefix's (H_kv, P, D) keys and values in ``prefix``."""
        pool = self.pool
        if pool.keys[layer] is None:
            n = pool.num_blocks * pool.page
            pool.keys[layer] = k.new_zeros(k.size(1), n, k.size(3))
            pool.values[layer] = v.new_zeros(v.size(1), n, v.size(3))
        K, V = pool.keys[layer], pool.values[layer]
        if self.all_real:  # every input is a new token (decoding, or prefill chunks of one length)
            kn, vn = k.transpose(0, 1).flatten(1, 2), v.transpose(0, 1).flatten(1, 2)  # (H_kv, B * T, D)
        else:
            kn = k.transpose(1, 2)[self.real].transpose(0, 1)
            vn = v.transpose(1, 2)[self.real].transpose(0, 1)
        K.index_copy_(1, self.dst, kn)
        V.index_copy_(1, self.dst, vn)
        if self._prefix_span is not None:
            a, b = self._prefix_span
            self.prefix = (K[:, a:b], V[:, a:b])
        elif self._prefix_idx is not None:
            self.prefix = (K.index_select(1, self._prefix_idx), V.index_select(1, self._prefix_idx))
        shape = (K.size(0), *self.gather.shape, K.size(2))  # (H_kv, B, S, D)
        idx = self.gather.view(-1)  # index_select: one pass, several times faster than K[gather] on CPU
        n = shape[0] * idx.numel() * shape[3]
        kb, vb = pool.scratch(n, K)
        flat = (shape[0], idx.numel(), shape[3])
        k_all = torch.index_select(K, 1, idx, out=kb[:n].view(flat))
        v_all = torch.index_select(V, 1, idx, out=vb[:n].view(flat))
        return k_all.view(shape).transpose(0, 1), v_all.view(shape).transpose(0, 1)
