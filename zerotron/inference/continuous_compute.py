"""The forwards of :class:`~zerotron.inference.continuous.ContinuousDecoder` on this rank's
replica (steps 3 and 4 of :mod:`zerotron.inference.continuous`): a decode step of the running rows
(with speculative drafts verified), the prefill of the admitted chunks, this rank's span of the
model over the paged cache (pipeline activations received and sent on), and the sampling of the
last stage. A mixin: the decoder sets ``rows``, ``drafts``, ``draft_model``, ``compiled``, ``pool``,
``page``, ``device``, ``shared_prefix``, ``attn_modules``, ``pl``, ``first``, ``last``, ``blocks``,
``layers``, ``engine`` and ``prefix_forwards``."""
from __future__ import annotations

import torch

from zerotron.distributed import comm

from .batch import PAD_ID
from .forward import forward_layers
from .paged import PagedView
from .prefix_attention import shared_prefix_hooks
from .sampling import sample_rows
from .speculative import accept_drafts


class ContinuousCompute:
    """This rank's forwards and sampling; mixed into
    :class:`~zerotron.inference.continuous.ContinuousDecoder`."""

    # ---- compute (this rank's replica only) -------------------------------------------------------------
    def _decode(self, rids: list[int]) -> dict[int, list[int]]:
        """One decoding step of ``rids``: each row's last token (and its draft tokens, verified)."""
        rows = [self.rows[r] for r in rids]
        drafts = [self.drafts.get(r, []) for r in rids]
        if self.draft_model is not None:  # the counts were fixed by the schedule; the draft fills them in
            for rid, r, d in zip(rids, rows, drafts):
                if d:
                    ctx = torch.tensor([r.tokens], device=self.device)
                    d[:] = self.draft_model.generate(ctx, len(d), temperature=0)[0, -len(d):].tolist()
        news = [1 + len(d) for d in drafts]
        T = max(news)
        if T == 1 and self.compiled is not None and not self._may_share(rows):  # one compiled call
            logits = self.compiled([r.tokens[-1] for r in rows], [r.table for r in rows], [r.cached for r in rows])
            return {r: [t] for r, t in self._sample(rids, logits).items()}
        x = torch.tensor([[PAD_ID] * (T - n) + [r.tokens[-1]] + d for r, d, n in zip(rows, drafts, news)],
                         device=self.device)
        view = PagedView(self.pool, [r.table for r in rows], [r.cached for r in rows], news, self.device,
                         self.shared_prefix)
        if T == 1:  # (compiled: only rows that share a prefix come here; their attention reads it once, eagerly)
            return {r: [t] for r, t in self._sample(rids, self._forward(x, view)).items()}
        logits = self._forward(x, view, all_logits=True)
        if logits is None:
            return {}
        return {rid: accept_drafts(logits[b, T - n:], d, r.request.params, r.generator)
                for b, (rid, r, d, n) in enumerate(zip(rids, rows, drafts, news))}

    def _may_share(self, rows: list) -> bool:
        """Whether the rows of a forward may start with shared cached blocks (shared-prefix
        attention on, several rows, each with a full cached block, all with the same first
        block): only then does :class:`~zerotron.inference.paged.PagedView` look for a prefix."""
        if not self.shared_prefix or len(rows) < 2 or min(r.cached for r in rows) < self.page:
            return False
        first = rows[0].table[0]
        return all(r.table[0] == first for r in rows)

    def _prefill(self, fills: list[tuple[int, int]], forks: dict[int, int]) -> dict[int, int]:
        """Prefill chunks ``fills`` = [(row, tokens)] together; the rows whose prompt is then
        complete (and their forks) sample their first token."""
        rids = [r for r, _ in fills]
        rows = [self.rows[r] for r in rids]
        news = [n for _, n in fills]
        T = max(news)
        x = []
        for r, n in zip(rows, news):
            lo = r.base + r.cached
            x.append([PAD_ID] * (T - n) + r.tokens[lo:lo + n])
        view = PagedView(self.pool, [r.table for r in rows], [r.cached for r in rows], news, self.device,
                         self.shared_prefix)
        logits = self._forward(torch.tensor(x, device=self.device), view)
        if logits is None:
            return {}
        at = {r: i for i, (r, row, n) in enumerate(zip(rids, rows, news))
              if row.cached + n == len(row.tokens) - row.base}
        fk = [f for f, lead in forks.items() if lead in at]
        keep = list(at) + fk
        out = self._sample(keep, logits[[at[r] for r in at] + [at[forks[f]] for f in fk]])
        return {r: [t] for r, t in out.items()}

    def _forward(self, x: torch.Tensor, cache, all_logits: bool = False) -> torch.Tensor | None:
        """This rank's span of the model on x: token ids (b, T) on the first stage, else the
        previous stage's activations (b, T, C), received here; returns logits (b, V) on the last
        stage, else sends the activations on and returns None."""
        pl = self.pl
        if not self.first:
            buf = torch.empty(x.size(0), x.size(1), pl.width, dtype=pl.act_dtype, device=self.device)
            comm.recv(buf, pl.prev, group=pl.group, tag="decode")
            x = buf
        self.prefix_forwards += bool(cache.prefix_blocks)
        with shared_prefix_hooks(self.attn_modules, cache):
            y = forward_layers(self.engine.model, self.blocks, self.layers, x, cache, self.first, self.last, all_logits)
        if not self.last:
            comm.send(y.to(pl.act_dtype).contiguous(), pl.next, group=pl.group, tag="decode")
            return None
        return y

    def _sample(self, rids, logits) -> dict[int, int]:
        if not self.last or logits is None:
            return {}
        rows = [self.rows[r] for r in rids]
        toks = sample_rows(logits, [r.request.params for r in rows], [r.generator for r in rows]).tolist()
        return dict(zip(rids, toks))
