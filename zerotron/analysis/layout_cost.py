"""Price one layout: :func:`evaluate` gives the predicted memory per GPU and the step time of a
(dp, tp, pp, cp, ep, ZeRO stage, schedule, micro-batch, recompute, offload) layout by the cost model
of :mod:`zerotron.analysis.cost_model` (formulas and sources in its docstring); the messages it times
are :mod:`zerotron.analysis.comm_messages`'. :func:`expert_degrees` is the rule for which ep a
mixture-of-experts layout takes."""
from __future__ import annotations

from functools import lru_cache

from zerotron.analysis.activations import activation_bytes, looped_counts, stage_layer_counts
from zerotron.analysis.bubble import pipeline_time
from zerotron.analysis.comm_messages import ring_messages, stream_bytes, sweep_calls, tp_messages
from zerotron.analysis.cost_model import CostModel, dp_time, exposed_dp, host_bytes, link_model
from zerotron.analysis.flops import Shape, m_flops, recompute_flops, shape_of, training_flops_per_token
from zerotron.analysis.hardware import collective_time
from zerotron.analysis.memory import model_state_bytes, stage_num_params
from zerotron.analysis.moe_memory import moe_all_to_all_bytes, moe_state_bytes
from zerotron.plan import CHUNKED_SCHEDULES


@lru_cache(maxsize=4096)
def _activations(shape: Shape, *args) -> dict:
    b, seq, tp, sp, pp, kind, m, v, recompute, attention = args
    return activation_bytes(shape, b, seq, tp=tp, sp=sp,
                            pp=pp, schedule="1f1b" if kind == "none" else kind, microbatches=m,
                            virtual_stages=v, recompute=recompute, dtype="bf16",
                            attention=attention)


def expert_degrees(shape: Shape, dp: int, pp: int, cp: int, rep: int = 1) -> list[int]:
    """Expert-parallel degrees to price (the plan's rules, ``ParallelPlan._check_experts``): for a
    mixture-of-experts model every ep dividing n_experts and the batch degree dp x cp (the ep group is
    carved out of the ranks holding different tokens; under HSDP with ``rep`` replicas the shard
    degree dp / rep x cp), and under a pipeline only without HSDP; else 1."""
    if not shape.n_experts or (pp > 1 and rep > 1):
        return [1]
    batch = dp // rep * cp
    return [e for e in range(1, batch + 1) if batch % e == 0 and shape.n_experts % e == 0]


def evaluate(cfg, layout: dict, seq: int, global_batch: int, cm: CostModel, memory_limit: int | None = None) -> dict:
    """Predicted memory and step time of ``layout`` (keys dp, tp, pp, zero_stage, schedule
    ("none" for pp = 1), micro_batch, recompute; optional dp_replicate (HSDP), ep (expert parallel,
    MoE models, :func:`expert_degrees`; the ValueError names the rule otherwise) and cp: context
    parallel with ring attention, each rank S/cp tokens, model states sharded over dp x cp, the
    ring's exposed transfer in ``cp_comm``) for the model of ``cfg`` (a GPT-2/Llama config or a
    :class:`Shape`), ``global_batch`` sequences of
    ``seq`` tokens per step (the cost model of :mod:`zerotron.analysis.cost_model`). Returns the layout plus
    ``microbatches``, ``virtual_stages``, ``sp``, ``memory_bytes_per_gpu`` (bytes),
    ``stage_time_s`` (seconds per micro-batch of each pipeline rank), ``predicted_step_time_s``,
    ``predicted_tokens_per_s``, ``predicted_mfu`` and ``time_breakdown_s`` (seconds per step: compute, vector, overhead, tp_comm, pp_comm of the
    slowest stage x m, ep_comm the token all-to-all; bubble; dp_comm exposed); for a MoE model also
    ``moe``: per pipeline rank ``state_bytes`` and ``expert_state_bytes`` (model states,
    :func:`~zerotron.analysis.moe_memory.moe_state_bytes`) and ``all_to_all_bytes`` per step (0 at ep 1).
    With ``memory_limit`` (bytes), a layout whose memory exceeds it is not priced further: the
    result is then only the layout and ``memory_bytes_per_gpu`` (what :func:`~zerotron.analysis.planner.plan` needs to drop it).
    Raises ValueError
    (from the estimators, or for an ep the rules refuse) for an impossible layout."""
    dp, tp, pp, b, z = (layout[k] for k in ("dp", "tp", "pp", "micro_batch", "zero_stage"))
    n_rep = layout.get("dp_replicate", 1)  # HSDP: replicas x (dp / n_rep) shards
    cp = layout.get("cp", 1)  # context parallel: each rank holds S / cp tokens of every sequence
    ep = layout.get("ep", 1)  # expert parallel (MoE): E / ep experts per rank, carved out of dp
    kind, rec, hw, K, sp = layout["schedule"], layout["recompute"], cm.hw, cm.gpus_per_node, cm.sp
    sp = sp and tp > 1
    v = 2 if kind in CHUNKED_SCHEDULES else 1
    m = global_batch // (dp * b)
    shape = cfg if isinstance(cfg, Shape) else shape_of(cfg)
    h, L, V, S, a, F = shape.n_embd, shape.n_layer, shape.vocab_size, seq, shape.n_head, shape.ffn
    W = shape.block_matmul_params()
    act = _activations(shape, b, S // cp, tp, sp, pp, kind, m, v, rec, cm.attention)
    counts = looped_counts(stage_layer_counts(L, pp * v), pp, kind)  # index chunk * pp + rank
    params = stage_num_params(shape, tp, pp, v, counts)
    off = layout.get("offload", "none")
    if ep > 1 and ep not in expert_degrees(shape, dp, pp, cp, n_rep):
        raise ValueError(f"ep ({ep}) needs a mixture-of-experts model and ep dividing n_experts ({shape.n_experts}) "
                         f"and the shard degree dp / dp_replicate x cp ({dp // n_rep} x {cp}), without HSDP under a "
                         "pipeline")
    # expert parameters of each pipeline rank (all E per layer; tp-replicated), of which ep > 1 keeps E/ep
    rank_layers = [sum(counts[c * pp + r] for c in range(v)) for r in range(pp)]
    experts = [n * shape.n_experts * 3 * h * F for n in rank_layers]
    toks = b * S // cp // (tp if sp else 1)  # tokens each rank routes per micro-batch (SP: its sequence shard)
    moe = None
    if shape.n_experts:  # dense over dp x cp, the local experts over the (dp x cp) / ep ranks holding them
        moe = {"state_bytes": [moe_state_bytes(p, e, dp, ep, z, "bf16-mixed", "adam", cp, n_rep, off)
                               for p, e in zip(params, experts)],
               "all_to_all_bytes": [moe_all_to_all_bytes(shape, n, toks, m, cm.elem_bytes, rec) if ep > 1 else 0
                                    for n in rank_layers]}

    def states(r):
        if moe:
            return moe["state_bytes"][r]["total_bytes"]
        return model_state_bytes(params[r], dp * cp, z, "bf16-mixed", "adam", n_rep, offload=off)["total_bytes"]
    mem = max(states(r) + a_ for r, a_ in enumerate(act["per_rank_bytes"])) + cm.overhead
    if memory_limit is not None and mem > memory_limit:  # plan() drops it: no time to price
        return {**layout, "memory_bytes_per_gpu": int(mem)}
    # ranks are ordered (pp, dp, cp, tp), tp innermost: a group fits a node iff its block does
    tp_link = link_model(hw, tp <= K and K % tp == 0)
    cp_link = link_model(hw, cp * tp <= K and K % (cp * tp) == 0)
    shard = dp // n_rep * cp * tp  # ranks spanned by one (shard-group x cp x tp) block
    dp_link = link_model(hw, shard <= K and K % shard == 0)
    rep_link = link_model(hw, dp * cp * tp <= K and K % (dp * cp * tp) == 0)  # the replicas' group spans the dp block
    pp_link = link_model(hw, dp * cp * tp * pp <= K)
    ep_link = link_model(hw, ep * tp <= K and K % (ep * tp) == 0)  # ep consecutive dp ranks x tp
    ring = ring_messages(shape, b, S, cp, rec, cm.elem_bytes)
    extra = recompute_flops(shape, S, rec)
    rep = 1 / tp if sp else 1  # share of the layer norms / residuals each tp rank computes
    act_vec = 2 * (shape.mlp_matrices - 1) * F  # GELU 2F, SwiGLU 4F (forward + backward)
    vec_layer = (4 * h + 2 * h) * rep + act_vec / tp + (2 * a * S / tp if cm.attention == "math" else 0)
    if rec == "full":
        vec_layer += (2 * h + 2 * h) * rep + act_vec / 2 / tp
    stream = stream_bytes(cm.elem_bytes, z)  # the residual stream's bytes per element (fp32 over ZeRO-0's params)
    x = b * S // cp * h * stream  # bytes of one (b, S/cp, h) activation of the stream: a pipeline message

    def tp_time(layers, first, last):  # one micro-batch's tensor-parallel collectives (tp_messages)
        return sum(collective_time(calls * nbytes, op, tp, *tp_link, calls=calls)
                   for op, nbytes, calls in tp_messages(shape, b * S // cp, sp, rec, cm.elem_bytes, stream, layers,
                                                        first, last))
    stage, parts, stage_times = -1.0, {}, []
    for r in range(pp):
        layers = sum(counts[c * pp + r] for c in range(v))
        first, last = r == 0, r == pp - 1
        flops = m_flops(shape, b, S, layers, last, tp, rec) / cp  # S/cp queries, each against all S keys
        vec = b * S / cp * (layers * vec_layer + (2 * V / tp if last else 0))
        # the ring's hops overlap the attention of the block in hand: exposed = transfer - attention
        attn_s = b * S / cp * (12 + 4 * (rec != "none")) * h * S / tp / (hw.peak_flops * cm.compute_eff)
        hops = collective_time(ring["kv"] * ring["kv_bytes"] + ring["dkv"] * ring["dkv_bytes"], "p2p",
                               2 if cp > 1 else 1, *cp_link, calls=ring["kv"] + ring["dkv"])
        t = {"compute": flops / (hw.peak_flops * cm.compute_eff), "vector": vec / hw.vector_rate,
             "overhead": layers * cm.launch_s,
             "pp_comm": collective_time(2 * v * (x / tp if sp else x), "p2p", 2 if pp > 1 else 1,
                                        *pp_link, calls=2 * v),
             "tp_comm": tp_time(layers, first, last),
             "cp_comm": layers * max(0.0, hops - attn_s),
             "ep_comm": collective_time(moe["all_to_all_bytes"][r] / m if moe else 0, "all_gather", ep, *ep_link,
                                        calls=(8 if rec == "full" else 5) * layers)}
        stage_times.append(sum(t.values()))
        if stage_times[-1] > stage:
            stage, parts = stage_times[-1], t
    # fill + drain run through every other stage once (in chunks of 1/v with interleaving): for
    # equal stages this is the bubble (p-1)/(v*m + p-1) of the whole step (bubble_theory); the
    # schedule's idle per rank relative to 1F1B's, at the F : B : W split of a layer's matmul FLOPs
    # (zero-bubble schedules: pipeline_idle)
    pipe = pipeline_time(stage_times, m, kind, v, (2 * W + 4 * h * S, 2 * W + 8 * h * S + extra, 2 * W))
    big = max(range(pp), key=lambda r: params[r])  # the rank with the most parameters
    root = params[big] - rank_layers[big] * shape.block_params(tp)  # embeddings, final norm, head of that rank
    fsdp2 = layout.get("zero_impl", "native") == "fsdp2"
    calls, root_calls = sweep_calls(shape, tp, rank_layers[big], big, pp, fsdp2)
    if ep == 1:
        t_dp = dp_time(z, m, calls, params[big], dp * cp, dp_link, cm, n_rep, rep_link, root, fsdp2, root_calls)
    else:  # the dense gradients over dp x cp, the local experts' over the (dp x cp) / ep ranks holding them
        t_dp = (dp_time(z, m, calls, params[big] - experts[big], dp * cp, dp_link, cm, n_rep, rep_link, root, fsdp2,
                         root_calls)
                + dp_time(z, m, rank_layers[big], experts[big] / ep, dp * cp // ep, dp_link, cm, n_rep, rep_link))
    t_dp = exposed_dp(t_dp, m * (parts["compute"] + parts["vector"]), hw.overlap)
    host = host_bytes(off, -(-max(params) // (dp * cp // n_rep)), m)
    if host and not cm.host_link:
        raise ValueError(f"offload {off!r} needs a host link to price (CostModel.host_link, --host-link)")
    t_host = host / cm.host_link if host else 0.0
    step = pipe + t_dp + t_host
    tokens = global_batch * S
    model_flops = training_flops_per_token(shape.flop_params(), L, h, S) * tokens
    breakdown = {k: m * val for k, val in parts.items()}
    breakdown.update(bubble=pipe - m * stage, dp_comm=t_dp)
    if off != "none":
        breakdown["host_comm"] = t_host
    if moe:  # what ``zerotron memory --ep`` reports for this layout (``analysis.moe_memory.moe_estimate``)
        layout = {**layout, "moe": {"state_bytes": [x["total_bytes"] for x in moe["state_bytes"]],
                                    "expert_state_bytes": [x["expert_state_bytes"] for x in moe["state_bytes"]],
                                    "all_to_all_bytes": moe["all_to_all_bytes"]}}
    return {**layout, "microbatches": m, "virtual_stages": v, "sp": sp,
            "stage_time_s": stage_times,
            "memory_bytes_per_gpu": int(mem), "predicted_step_time_s": step,
            **({"host_bytes_per_step": host} if off != "none" else {}),
            "predicted_tokens_per_s": tokens / step,
            "predicted_mfu": model_flops / (step * dp * cp * tp * pp * hw.peak_flops),
            "time_breakdown_s": breakdown}
