"""The planner's collective volume (``analysis.comm_messages.comm_bytes``) against what the code sends.

Each layout is dry-run in this process (4 fake ranks, bf16 -- where ZeRO-0's fp32 parameters keep
an fp32 residual stream and ZeRO >= 1 computes on bf16 copies --, the first and last pipeline
stage); tests/test_dryrun.py proves the dry run's bytes per (op, group, tag) equal a real gloo
run's. Per group the planner prices the traced bytes less the bookkeeping all-reduces it documents
as not priced: tp and pp exactly, dp up to ZeRO's / FSDP2's padding (below); and the ZeRO / FSDP2
collectives' calls exactly (native ZeRO sends one per flat buffer: a unit's weight-decay and no-decay
parameters, tp-sharded and replicated ones, in buffers of their own, ``comm_messages.dp_flat_calls``).
"""
import pytest

from zerotron.testing import ROOT, tiny_config

WORLD = 4
BASE = {"train.micro_batch": 2, "train.global_batch": 8, "model.block_size": 32, "train.dtype": "bf16"}
GPT, LLAMA = "tiny.toml", "llama_tiny.toml"
LAYOUTS = [  # (name, config, overrides): GPT-2 and Llama, tp, tp x pp, SP, recomputation, ZeRO-0/1/2/3, FSDP2
    ("gpt-ddp-tp2", GPT, {"parallel.tp": 2, "parallel.dp": 2}),
    ("gpt-ddp-tp2-full", GPT, {"parallel.tp": 2, "parallel.dp": 2, "train.activation_checkpointing": "full"}),
    ("llama-tp2-pp2-sp-full", LLAMA, {"parallel.tp": 2, "parallel.pp": 2, "parallel.sequence_parallel": "true",
                                      "train.activation_checkpointing": "full"}),
    ("llama-zero1-tp2-pp2-split31", LLAMA, {"parallel.tp": 2, "parallel.pp": 2, "parallel.zero_stage": 1,
                                            "parallel.pp_split": "3,1"}),  # an uneven split: layer_counts
    ("llama-zero2-tp2-dp2", LLAMA, {"parallel.tp": 2, "parallel.dp": 2, "parallel.zero_stage": 2}),
    ("gpt-zero3-tp2-dp2", GPT, {"parallel.tp": 2, "parallel.dp": 2, "parallel.zero_stage": 3}),
    ("llama-zero3-dp4", LLAMA, {"parallel.dp": 4, "parallel.zero_stage": 3}),
    ("gpt-fsdp2-dp4", GPT, {"parallel.dp": 4, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}),
]
# all-reduces comm_bytes documents as not priced: step bookkeeping, SP's replicated-parameter
# gradients (tp_grad), a pipeline's tied-embedding gradient (pp_tied)
UNPRICED = {"grad_norm", "grad_used", "loss_norm", "metrics", "tp_grad", "pp_tied"}
# padded pieces per dp collective call: ZeRO pads each flat buffer (a decay and a no-decay one per
# unit), FSDP2 each parameter's dim 0 (at most 12 tensors per GPT-2 block, 9 per Llama block)
PIECES = 12


@pytest.mark.parametrize("name,config,overrides", LAYOUTS, ids=[n for n, _, _ in LAYOUTS])
def test_planned_bytes_equal_the_traced(name, config, overrides):
    """Per traced rank and group: traced (priced tags) = planned for tp and pp; for dp/batch
    0 <= traced - planned <= calls x PIECES x (dp - 1) x 4 bytes (each padded piece adds fewer
    than dp elements of at most 4 bytes to a call's size), and traced calls = planned calls under
    ZeRO / FSDP2."""
    from zerotron.analysis.dryrun import default_ranks, dry_run
    from zerotron.distributed import comm
    from zerotron.plan import build_plan

    cfg = tiny_config({**BASE, **overrides}, ROOT / "configs" / config)
    recs = dry_run(cfg, WORLD, default_ranks(build_plan(cfg, WORLD).dims))
    comm.STATS.reset()
    for rec in recs:
        planned = rec["comm_bytes_planned"]
        assert planned, (name, rec["rank"])
        for group, want in planned.items():
            ops = {k: c for k, c in rec["comm_traced"][group]["ops"].items() if k.split("/")[1] not in UNPRICED}
            got = sum(c["bytes"] for c in ops.values())
            if group in ("tp", "pp"):
                assert got == want, (name, rec["rank"], group, got, want, ops)
            else:
                pad = sum(c["calls"] for c in ops.values()) * PIECES * (rec["estimated"]["dp"] - 1) * 4
                assert 0 <= got - want <= pad, (name, rec["rank"], group, got, want, pad, ops)
                if cfg.parallel.zero_stage:
                    calls = sum(c["calls"] for c in ops.values())
                    assert calls == rec["comm_calls_planned"][group], (name, rec["rank"], group, calls,
                                                                       rec["comm_calls_planned"], ops)


def test_stream_dtype_rule():
    """bf16 over fp32 parameters (ZeRO-0) keeps an fp32 residual stream; ZeRO >= 1 a bf16 one."""
    from zerotron.analysis.comm_messages import stream_bytes

    assert [stream_bytes(2, z) for z in range(4)] == [4, 2, 2, 2]
    assert [stream_bytes(4, z) for z in range(4)] == [4, 4, 4, 4]
