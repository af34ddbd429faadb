"""The sparse mixture-of-experts feed-forward layer (:class:`MoE`) of :mod:`zerotron.models.mixtral`:
router, top-k selection, capacity, auxiliary losses and the E SwiGLU experts, plus the hooks the
trainer calls on every MoE layer of a model (:func:`set_step_rows`, :func:`take_router_stats`,
:func:`update_expert_bias`).

A linear router (C -> E logits), top-k selection, and E SwiGLU experts; each token's output is the
router-weighted sum of its k experts' outputs (Shazeer et al. 2017, "Outrageously Large Neural
Networks"; Jiang et al. 2024, "Mixtral of Experts"). Routing rules (``moe_router``, :data:`ROUTERS`):

  * ``"topk_softmax"`` (Mixtral): softmax over the k largest logits (= softmax over all, top-k,
    renormalised: Qwen-MoE with ``norm_topk_prob = true``);
  * ``"softmax_topk"`` (Qwen-MoE with ``norm_topk_prob = false``): softmax over all E logits, the k
    largest probabilities used as they are.

Optionally a shared expert (a dense SwiGLU MLP every token passes, DeepSeekMoE, Dai et al. 2024;
``moe_shared_intermediate_size`` > 0), added to the routed output. Dropless by default: every token
reaches its k experts. Capacity mode (``moe_capacity_factor`` > 0, training forwards only; eval and
generation stay dropless): each expert takes at most ceil(factor * N * k / E) of one forward's N*k
assignments, first come first served in (token, slot) order (:meth:`MoE.capacity_keep`); the rest
are dropped. N is the forward's own token count, so the set dropped depends on how the step's
rows are cut into forwards: equal on every layout with the same ``train.micro_batch`` rows per
forward (dp, ep, tp, pp), not across micro-batch sizes. Optional auxiliary-loss-free balancing
(``moe_bias_update_rate``, :func:`update_expert_bias`). Auxiliary losses, per MoE layer over the
tokens of one micro-batch (a forward of several, the naive pipeline's flush, is taken in groups of
``train.micro_batch`` rows; under sequence or context parallelism each rank routes its shard of the
sequences and the statistics are summed over the shards, ``MoE.token_sum``):

  * load balancing (Switch Transformer, Fedus et al. 2021, eq. 4): ``E * sum_i f_i * P_i`` with f_i
    the fraction of the N*k token-to-expert assignments sent to expert i times k (so sum f_i = k,
    HF's ``load_balancing_loss_func`` convention) and P_i the mean router probability of expert i;
    k at perfect balance;
  * router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2.

The step objective is cross-entropy + ``moe_aux_loss_coef`` * aux + ``moe_z_loss_coef`` * z with
aux and z each the mean over MoE layers and over the step's micro-batches (a micro-batch of b rows
weighs b / rows-per-step, :func:`set_step_rows`). Their gradient enters through the layer's output
(:class:`_AddAuxGrad`, the trick of Megatron-Core's ``MoEAuxLossAutoScaler``): the losses need no
path to the trainer, so pipeline stages, recomputation and every gradient synchroniser carry them
unchanged, and the result does not depend on the layout (micro-batches are contiguous slices of the
global batch at a fixed ``train.micro_batch``). Router statistics (counts per expert, aux, z) are
summed per layer in ``MoE.stats`` for metrics (:func:`take_router_stats`).

Expert compute is batched per expert: the N*k assignments are sorted by expert (stable), each
expert runs its SwiGLU on one contiguous slice (torch 2.13's ``torch._grouped_mm`` takes no float64
and needs 16-byte-aligned strides on CPU, so a loop over experts), and the outputs are scattered
back weighted. Expert parallelism replaces the step "sorted rows -> expert outputs" through the
``dispatch`` hook the layout names (:class:`zerotron.models.layout.ExpertLayout`).

Shapes: B batch, T positions, C = n_embd, E = n_experts, k = experts_top_k, F = intermediate_size
(per expert), N = B*T tokens.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import LlamaConfig, LlamaMLP

__all__ = ["MoE", "Experts", "ROUTERS", "local_experts", "set_step_rows", "take_router_stats", "update_expert_bias"]

ROUTERS = ("topk_softmax", "softmax_topk")


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``x`` that, in the backward, also sends gradient 1 into ``aux`` (a scalar already
    scaled by its weight): the auxiliary loss joins the objective wherever ``x``'s backward runs."""

    @staticmethod
    def forward(ctx, x, aux):
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_ones(ctx.aux_shape)


class Experts(nn.Module):
    """E SwiGLU experts stored stacked: ``gate_proj``/``up_proj`` (E, F, C), ``down_proj`` (E, C, F).

    ``forward(x, counts)``: x (M, C) rows sorted by expert, ``counts`` (E,) int64 rows per expert
    (sum M) -> (M, C), expert e applied to its slice: down_e(silu(gate_e x) * up_e x). Every expert
    runs (an empty slice too), so every parameter takes part in each backward. Expert parallelism
    keeps a contiguous range of experts here (``local_experts``)."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.up_proj = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.down_proj = nn.Parameter(torch.empty(n_experts, n_embd, hidden))

    @property
    def n_local(self) -> int:
        """Experts held here."""
        return self.gate_proj.size(0)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start:start + n]
            h = F.silu(xe @ self.gate_proj[e].t()) * (xe @ self.up_proj[e].t())
            outs.append(h @ self.down_proj[e].t())
            start += n
        return torch.cat(outs, dim=0)


def local_experts(experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The dense dispatch: every expert is here, rows go straight to :meth:`Experts.forward`."""
    return experts(x, counts)


class MoE(nn.Module):
    """Sparse MoE feed-forward: (B, T, C) -> (B, T, C). ``gate`` (C -> E, no bias) is the router,
    ``experts`` an :class:`Experts`, ``shared_expert`` a SwiGLU MLP or absent.

    ``dispatch(experts, rows, counts) -> outputs`` runs the experts on rows sorted by expert
    (default :func:`local_experts`; expert parallelism installs its all-to-all). ``step_rows``:
    sequences per optimizer step (None: this forward is the whole step), setting the auxiliary
    losses' weight b / step_rows; ``micro_rows``: rows of one micro-batch (None: the forward's), so a
    forward of several micro-batches (the naive pipeline's concatenated flush) takes its auxiliary
    losses per micro-batch. ``token_sum``: None, or a (not differentiable) sum of a tensor over the
    ranks holding the other positions of this forward's sequences (sequence / context
    parallelism, :func:`zerotron.models.layout.add_token_sum`): f_i, P_i and the z-loss are then
    taken over the whole micro-batch, each rank back-propagating its own tokens' share (the
    synchroniser sums those gradients over the shards, as for any replicated parameter). ``aux_loss_scale``: the factor their gradient is multiplied by
    (1; FSDP2 sets dp, see ``models.layout.scale_aux_losses``); the recorded stats are unscaled. ``stats``: per-layer sums since the last :func:`take_router_stats`
    (float64 (E + 2,): assignments per expert, weighted aux, weighted z), training forwards only
    (not recomputation). ``cfg``: a :class:`~zerotron.models.mixtral.MixtralConfig` (Llama's fields
    and the MoE ones, read here by name: ``n_experts``, ``experts_top_k``, ``moe_*``)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int = 0):
        super().__init__()
        self.n_experts, self.top_k, self.router = cfg.n_experts, cfg.experts_top_k, cfg.moe_router
        self.aux_coef, self.z_coef, self.layer_idx = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef, layer_idx
        self.n_moe_layers = cfg.n_layer
        self.gate = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.n_embd, cfg.intermediate_size)
        if cfg.moe_shared_intermediate_size:
            self.shared_expert = LlamaMLP(dataclasses.replace(cfg, intermediate_size=cfg.moe_shared_intermediate_size))
        else:
            self.shared_expert = None
        self.dropout = nn.Dropout(cfg.dropout)
        self.dispatch = local_experts
        self.step_rows: int | None = None
        self.micro_rows: int | None = None  # rows of one micro-batch (set_step_rows)
        self.token_sum = None  # sum over the ranks holding the rest of these sequences (models.layout.add_token_sum)
        self.aux_loss_scale = 1.0  # set by a synchroniser that scales the token loss (models.layout)
        self.stats: torch.Tensor | None = None
        self.capacity_factor, self.bias_rate = cfg.moe_capacity_factor, cfg.moe_bias_update_rate
        self.dropped = 0  # assignments over capacity since the last take_router_stats
        if self.bias_rate:  # part of the state (checkpoints) only when the balancing is on
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> (weights (N, k), expert ids (N, k) int64) by ``moe_router``.
        With the balancing bias (``expert_bias``, DeepSeek-V3, Liu et al. 2024, sec. 2.1.2) the
        bias is added to the scores for the top-k *selection* only; the weights are those of the
        unbiased scores of the selected experts."""
        bias = getattr(self, "expert_bias", None)
        if self.router == "topk_softmax":
            if bias is None:
                top, idx = torch.topk(logits, self.top_k, dim=-1)
            else:
                idx = torch.topk(logits + bias.to(logits.dtype), self.top_k, dim=-1).indices
                top = logits.gather(-1, idx)
            return F.softmax(top, dim=-1), idx
        probs = F.softmax(logits, dim=-1)
        if bias is None:
            return torch.topk(probs, self.top_k, dim=-1)
        idx = torch.topk(probs + bias.to(probs.dtype), self.top_k, dim=-1).indices
        return probs.gather(-1, idx), idx

    def capacity_keep(self, flat: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Capacity mode (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021): a
        bool mask over the expert-sorted assignments ``order`` (N*k,) of the expert ids ``flat``
        (N*k,) keeping at most C = ceil(capacity_factor * N * k / E) per expert. Rule: first come,
        first served in the order of the flattened (token, slot) pairs of this forward -- tokens
        in row-major (batch row, position) order, a token's k slots in rank order (the stable sort
        keeps that order within an expert). A dropped assignment adds nothing (the residual
        carries the token; its other experts' weights are not renormalised)."""
        cap = math.ceil(self.capacity_factor * flat.numel() / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(order.numel(), device=order.device) - starts[flat[order]]
        return pos < cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = x.reshape(-1, C)
        logits = self.gate(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # routing in >= fp32
        weights, idx = self.route(logits)  # (N, k)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # assignments sorted by expert
        counts = torch.bincount(flat, minlength=self.n_experts)
        routed = counts
        if self.capacity_factor and self.training:
            keep = self.capacity_keep(flat, order, counts)
            order = order[keep]
            routed = torch.bincount(flat[order], minlength=self.n_experts)
            if torch._C._current_graph_task_id() == -1:
                self.dropped += int(flat.numel() - order.numel())
        token = order // self.top_k
        y = self.dispatch(self.experts, h[token], routed)  # (M, C), in sorted order
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(h).index_add_(0, token, y)
        if self.shared_expert is not None:
            out = out + self.shared_expert(h)
        out = self.dropout(out.view(B, T, C))
        if self.training:
            out = self._aux(out, logits, idx, B)
        return out

    def _aux(self, out: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor, rows: int) -> torch.Tensor:
        """Attach the weighted auxiliary losses of this forward to ``out`` and record the stats.
        ``logits`` (N, E) and ``idx`` (N, k) of this rank's N tokens of ``rows`` sequences, taken in
        groups of ``micro_rows`` rows (one group per micro-batch); with ``token_sum`` the counts,
        token numbers and probability sums of each group are summed over the sequence shards first."""
        E, mr = self.n_experts, self.micro_rows
        G = rows // mr if mr and rows > mr and rows % mr == 0 else 1
        lg = logits.view(G, -1, E)  # (G, n, E): each micro-batch's tokens held here
        psum = F.softmax(lg, dim=-1).sum(1)  # (G, E)
        lse2 = torch.logsumexp(lg, dim=-1).square().sum(1)  # (G,)
        ix = idx.reshape(G, -1)
        cnt = psum.new_zeros(G, E).scatter_add_(1, ix, torch.ones_like(ix, dtype=psum.dtype))  # assignments
        local = torch.cat([cnt, psum.new_full((G, 1), float(lg.size(1))), psum.detach(), lse2.detach()[:, None]], 1)
        tot = self.token_sum(local) if self.token_sum is not None else local
        cnt_t, n_t, p_t, z_t = tot[:, :E], tot[:, E], tot[:, E + 1:2 * E + 1], tot[:, 2 * E + 1]
        frac = cnt_t / n_t[:, None]  # f_i over each micro-batch's tokens (sums to k)
        aux_here = E * (frac * psum).sum(1) / n_t  # this rank's tokens' share of E sum f_i P_i, (G,)
        z_here = lse2 / n_t
        weight = (rows / G) / self.step_rows if self.step_rows else 1.0 / G  # per micro-batch
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            scaled = (self.aux_coef * aux_here + self.z_coef * z_here).sum() * (
                weight / self.n_moe_layers * self.aux_loss_scale)
            out = _AddAuxGrad.apply(out, scaled)
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside a backward
            aux = E * (frac * p_t).sum(1) / n_t
            rec = torch.cat([cnt_t.sum(0), torch.stack([aux.sum(), (z_t / n_t).sum()]) * weight])
            rec = rec.detach().double().cpu()
            self.stats = rec if self.stats is None else self.stats + rec
        return out


def _moe_layers(module: nn.Module):
    return [m for m in module.modules() if isinstance(m, MoE)]


def set_step_rows(module: nn.Module, rows: int | None, micro_rows: int | None = None) -> None:
    """Tell every MoE layer of ``module`` how many sequences one optimizer step has (the weight of
    a micro-batch's auxiliary losses is its rows / ``rows``; None: each forward is a whole step)
    and, with ``micro_rows``, how many one micro-batch has (a forward of several micro-batches
    takes its auxiliary losses per micro-batch, in row order: as one process running them one by one)."""
    for m in _moe_layers(module):
        m.step_rows, m.micro_rows = rows, micro_rows


def take_router_stats(module: nn.Module, n_layer: int, n_experts: int,
                      dropped: torch.Tensor | None = None) -> torch.Tensor | None:
    """The router statistics the MoE layers of ``module`` summed since the last call, and reset:
    float64 (n_layer, E + 2) -- per global layer index: assignments per expert (routing decisions,
    before any capacity drop), then the weighted aux and z losses (rows of layers this module does
    not hold are 0) -- or None without MoE layers. The assignments dropped over capacity since the
    last call (:attr:`MoE.dropped`) go to ``dropped`` (n_layer,) when given, and are reset too."""
    layers = _moe_layers(module)
    if not layers:
        return None
    out = torch.zeros(n_layer, n_experts + 2, dtype=torch.float64)
    for m in layers:
        if m.stats is not None:
            out[m.layer_idx] += m.stats
            m.stats = None
        if dropped is not None:
            dropped[m.layer_idx] += m.dropped
        m.dropped = 0
    return out


@torch.no_grad()
def update_expert_bias(module: nn.Module, counts: torch.Tensor) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, Liu et al. 2024, sec. 2.1.2): after each
    optimizer step, every MoE layer of ``module`` with ``moe_bias_update_rate`` u > 0 moves its
    ``expert_bias`` by b_i += u * sign(mean(c) - c_i), c = ``counts[layer_idx]``, the step's
    assignments per expert of that layer over the *whole* batch (``counts``: float64 (n_layer, E),
    summed over the data-parallel ranks and micro-batches by the caller, so every layout applies
    the same update). Overloaded experts become less likely to be selected, underloaded ones more."""
    for m in _moe_layers(module):
        if not m.bias_rate:
            continue
        c = counts[m.layer_idx]
        m.expert_bias += (m.bias_rate * torch.sign(c.mean() - c)).to(m.expert_bias.dtype)
