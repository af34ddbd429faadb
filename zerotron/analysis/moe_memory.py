"""What a mixture-of-experts model costs per rank under expert parallelism ep (carved out of the
batch group dp x cp, ``zerotron.parallel.expert``): model states of the dense and the local expert
parameters (:func:`moe_state_bytes`, the ZeRO rule of :func:`zerotron.analysis.memory.model_state_bytes`
per part), the token all-to-all's bytes (:func:`moe_all_to_all_bytes`) and both per pipeline rank
with total vs active parameters and FLOPs per token (:func:`moe_estimate`: what ``zerotron memory
--ep`` prints and ``zerotron plan`` prices). Pure arithmetic."""
from __future__ import annotations

from zerotron.analysis.activations import looped_counts, stage_layer_counts
from zerotron.analysis.flops import shape_of
from zerotron.analysis.memory import STAGES, model_state_bytes, stage_num_params
from zerotron.plan import CHUNKED_SCHEDULES


def moe_state_bytes(params: int, experts: int, dp: int, ep: int, stage: int, dtype: str = "fp32",
                    optimizer: str = "adam", cp: int = 1, dp_replicate: int = 1, offload: str = "none") -> dict:
    """Model-state bytes of one rank holding ``params`` parameters (its tp / pipeline share, all E
    experts of its MoE layers counted) of which ``experts`` are expert parameters, under expert
    parallelism ``ep`` carved out of the batch group dp x cp (``zerotron.parallel.expert``): the
    dense ``params - experts`` under ZeRO ``stage`` over dp x cp (HSDP: over dp / R x cp) and the
    rank's ``experts / ep`` under it over the (dp x cp) / ep ranks that hold the same experts (the
    expert-replica group; native ZeRO shards the expert flat buffers over it; HSDP: / R). At ep 1
    the experts are sharded with the rest, over dp x cp. Each part by :func:`model_state_bytes`
    (ZeRO paper, section 3), so a padded shard is counted per part. Returns
    ``{"dense_state_bytes", "expert_state_bytes", "total_bytes"}`` (bytes per rank). Raises
    ValueError for an ep that does not divide experts or the shard degree dp / R x cp, or the
    arguments :func:`model_state_bytes` refuses."""
    batch = dp * cp
    if ep < 1 or experts % ep or (dp // max(dp_replicate, 1) * cp) % ep or not 0 <= experts <= params:
        raise ValueError(f"ep ({ep}) must divide the expert parameters ({experts}) and the shard degree dp / "
                         f"dp_replicate x cp ({dp} / {dp_replicate} x {cp}), experts within params ({params})")
    dense = model_state_bytes(params - experts, batch, stage, dtype, optimizer, dp_replicate, offload=offload)
    local = model_state_bytes(experts // ep, batch // ep, stage, dtype, optimizer, dp_replicate, offload=offload)
    return {"dense_state_bytes": dense["total_bytes"], "expert_state_bytes": local["total_bytes"],
            "total_bytes": dense["total_bytes"] + local["total_bytes"]}


def moe_all_to_all_bytes(cfg, layers: int, tokens: int, microbatches: int, elem_bytes: int,
                         recompute: str = "none") -> int:
    """Bytes one rank of an ep group sends per optimizer step by the token all-to-all (the mean over
    the group; ``comm.all_to_all_v`` counts the bytes a rank sends, its own rows included) for
    ``layers`` MoE layers, ``microbatches`` micro-batches of ``tokens`` routed tokens each (b x S /
    cp per rank; / tp more under sequence parallelism, where each tp rank routes its shard) and
    ``elem_bytes`` per activation element: per layer and micro-batch the dispatch and the combine in
    the forward and again in the backward, 4 x tokens x k x C elements, plus the per-expert counts
    (E int64) of each forward; ``recompute`` "full" re-runs the forward in the backward (one more
    dispatch + combine + counts: 6 exchanges); "selective" recomputes attention only.
    A single rank sends its N*k rows in the dispatch but, in the combine, the rows its experts
    received: that half depends on the routing; the sum over the group is exact."""
    s = shape_of(cfg)
    fwd = 2 if recompute == "full" else 1
    return layers * microbatches * ((2 + 2 * fwd) * tokens * s.top_k * s.n_embd * elem_bytes + fwd * 8 * s.n_experts)


def moe_estimate(cfg, dp: int, ep: int = 1, stage: int = 0, dtype: str = "fp32", optimizer: str = "adam",
                 seq: int | None = None, micro_batch: int = 1, microbatches: int = 1, cp: int = 1,
                 dp_replicate: int = 1, tp: int = 1, sp: bool = False, pp: int = 1, schedule: str = "1f1b",
                 virtual_stages: int = 1, recompute: str = "none") -> dict:
    """What a mixture-of-experts model costs per rank under expert parallelism ``ep`` carved out of
    the batch group ``dp`` x ``cp`` (``zerotron.parallel.expert``), from the shape of ``cfg`` (any
    config :func:`shape_of` reads, with ``n_experts`` > 0), at tensor / pipeline parallelism ``tp``,
    ``pp`` (``schedule``, ``virtual_stages`` chunks per rank). Pure arithmetic. Returns a dict:

      * ``total_params``, ``active_params`` (one token: router + k of E experts per layer, the rest),
        ``expert_params`` (all layers, all E experts), ``dense_params`` (total - expert);
      * ``flops_per_token``: training FLOPs from the active parameters, 6 N_active + 12 L C S
        (PaLM appendix B with N the matmul parameters a token meets; needs ``seq``, else 6 N_active);
      * of the largest pipeline rank (all of the model at pp = 1): ``expert_params_per_rank`` (its
        layers' experts / ep),
        ``expert_state_bytes`` (its E/ep experts' params + grads + optimizer under ZeRO ``stage``
        over the (dp x cp) / ep ranks holding them) and ``dense_state_bytes`` (the rest under
        ``stage`` over dp x cp): :func:`moe_state_bytes`;
      * ``all_to_all_bytes`` per rank and optimizer step of the largest pipeline rank, the mean over
        the ep group (ep > 1 and ``seq`` given; else 0): :func:`moe_all_to_all_bytes` for the
        ``microbatches`` micro-batches of ``micro_batch`` x ``seq`` / cp tokens (/ tp with ``sp``);
      * ``pipeline_ranks``: per pipeline rank ``{"params", "expert_params"`` (all E per layer),
        ``"layers", "all_to_all_bytes", "states": [{"stage", "dense_state_bytes",
        "expert_state_bytes", "total_bytes"}`` for ZeRO stages 0-3]}`` -- what ``zerotron plan``
        prices for an ep layout (``analysis.layout_cost.evaluate``).
    Raises ValueError for a dense model, ep < 1 or an ep that does not divide E or dp x cp (the
    shard degree dp / dp_replicate x cp under HSDP)."""
    s = shape_of(cfg)
    E = s.n_experts
    if not E:
        raise ValueError("moe_estimate needs a mixture-of-experts model (n_experts > 0)")
    if ep < 1 or E % ep or (dp // max(dp_replicate, 1) * cp) % ep:
        raise ValueError(f"--ep ({ep}) must be >= 1 and divide n_experts ({E}) and the batch degree dp x cp "
                         f"({dp} x {cp}; the shard degree dp / dp_replicate x cp under HSDP)")
    expert = s.n_layer * E * 3 * s.n_embd * s.ffn
    total, active = s.num_params(), s.active_params()
    flops = 6 * s.flop_params() + (12 * s.n_layer * s.n_embd * seq if seq else 0)
    elem = {"fp32": 4, "fp64": 8}.get(dtype, 2)  # the activations' dtype (bf16-mixed: 2)
    v = virtual_stages if schedule in CHUNKED_SCHEDULES else 1
    counts = looped_counts(stage_layer_counts(s.n_layer, pp * v), pp, schedule)  # index chunk * pp + rank
    ranks = []
    tokens = micro_batch * (seq or 0) // cp // (tp if sp and tp > 1 else 1)
    for r, params in enumerate(stage_num_params(s, tp, pp, v, counts)):
        layers = sum(counts[c * pp + r] for c in range(v))
        experts = layers * E * 3 * s.n_embd * s.ffn
        states = [{"stage": z, **moe_state_bytes(params, experts, dp, ep, z, dtype, optimizer, cp, dp_replicate)}
                  for z in STAGES]
        a2a = moe_all_to_all_bytes(s, layers, tokens, microbatches, elem, recompute) if ep > 1 and seq else 0
        ranks.append({"params": params, "expert_params": experts, "layers": layers, "all_to_all_bytes": a2a,
                      "states": states})
    top = max(ranks, key=lambda x: x["states"][stage]["total_bytes"])
    return {"total_params": total, "active_params": active, "expert_params": expert, "dense_params": total - expert,
            "flops_per_token": flops, "expert_params_per_rank": top["expert_params"] // ep,
            "expert_state_bytes": top["states"][stage]["expert_state_bytes"],
            "dense_state_bytes": top["states"][stage]["dense_state_bytes"],
            "all_to_all_bytes": top["all_to_all_bytes"], "pipeline_ranks": ranks}
