"""The estimator describes what the code allocates at the peak (issue 33): a dry run's traced peak
of one step (MemTracker over fake tensors) against ``analysis.dryrun.estimate`` on a small Llama
shape in bf16 (autocast), plain runner: tensor parallel over fp32 parameters (autocast's per-Linear
input casts and weight casts, the vocab-parallel loss) and ZeRO-3 over bf16 compute copies (the
gathered root unit, ``F.cross_entropy``'s backward), with and without full recomputation.

Tolerance, derived: every buffer the estimate counts is counted exactly (bytes of the same
tensors); what it leaves out are tensors of a few elements per token or per row -- RMSNorm's
rsqrt kept by its backward beyond the saved statistics, the int64 token ids and targets (16 bytes
per token), the loss's scalars and row statistics (4 bytes per token each, a handful), the fp32
RoPE tables (buffers, 128 KiB here) -- about 0.3-0.5 % of this shape's peak (measured
1.0014-1.0049), so 1 %: a missing (b, s, h) tensor of one layer is 1.5 % here and fails it.
Not modelled, within the 1 % here: the recomputed block's own weight casts and backward
temporaries over fp32 parameters (``tp2-full-casts``: 1.0086).
"""
import pytest

from zerotron.testing import tiny_config

BASE = {"model.preset": "llama-tiny", "model.arch": "llama", "model.bias": "false", "model.n_layer": 4,
        "model.n_embd": 256, "model.n_head": 8, "model.n_kv_head": 2, "model.intermediate_size": 512,
        "model.vocab_size": 4096, "model.block_size": 512, "train.dtype": "bf16", "train.micro_batch": 1}
# (name, world, traced rank, overrides)
LAYOUTS = [("tp2", 2, 0, {"parallel.tp": 2, "train.global_batch": 1}),
           ("zero3-dp4-full", 4, 0, {"parallel.dp": 4, "parallel.zero_stage": 3, "train.global_batch": 4,
                                     "train.activation_checkpointing": "full"}),
           # FSDP2: fp32 gradient shards freed between steps, the root resharded after the forward
           ("fsdp2-dp4", 4, 0, {"parallel.dp": 4, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2",
                                "train.global_batch": 4}),
           # ... and with full recomputation at a shape where the blocks' gradient shards outweigh the
           # activations (Llama-3-70B's): the peak is the last block's backward, with the shards of the blocks
           # done, the reduce-scatter / all-gather buffers, the gathered root (1.503 unmodelled; 70B: 1.216)
           ("fsdp2-dp4-full-grads", 4, 0, {"parallel.dp": 4, "parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2",
                                           "train.global_batch": 4, "train.activation_checkpointing": "full",
                                           "model.n_layer": 8, "model.n_embd": 512, "model.intermediate_size": 1024,
                                           "model.vocab_size": 1024, "model.block_size": 256}),
           # native ZeRO-3 with full recomputation at that shape: the peak is a mid-backward block's, with two
           # blocks gathered, the prefetch's gather input, the reduce window's fp32 inputs, the gathered root
           # and the head's gradient (1.42 unmodelled; Llama-3-70B dp 8: 1.031)
           ("zero3-dp4-full-grads", 4, 0, {"parallel.dp": 4, "parallel.zero_stage": 3, "train.global_batch": 4,
                                           "train.activation_checkpointing": "full", "model.n_layer": 8,
                                           "model.n_embd": 512, "model.intermediate_size": 1024,
                                           "model.vocab_size": 1024, "model.block_size": 128}),
           # the last pipeline stage of 8 micro-batches: its received inputs and sent input gradients
           # (were all kept: 1.13 before the dry run's tracker and fake sends stopped holding them)
           ("zero1-pp2-last", 2, 1, {"parallel.pp": 2, "parallel.zero_stage": 1, "train.global_batch": 8}),
           # the first stage with full recomputation peaks in finish_grads (ZeRO-1's reduce window; 1.11 unmodelled)
           ("zero1-pp2-first-full", 2, 0, {"parallel.pp": 2, "parallel.zero_stage": 1, "train.global_batch": 8,
                                           "train.activation_checkpointing": "full"}),
           # a first stage peaks in a block's backward: the SwiGLU backward's gradients (1.013 unmodelled) ...
           ("zero1-pp2-first", 2, 0, {"parallel.pp": 2, "parallel.zero_stage": 1, "train.global_batch": 4}),
           # ... and with tp and full recomputation RMSNorm's composite fp32 backward, the checkpointed
           # input beside the norm's fp32 copy (1.024 unmodelled; Llama-3-8B tp 8 x pp 4: 1.095)
           ("zero1-tp2-pp2-full-first", 4, 0, {"parallel.tp": 2, "parallel.pp": 2, "parallel.zero_stage": 1,
                                               "train.global_batch": 4, "train.activation_checkpointing": "full"}),
           # fp32 parameters under autocast with full recomputation: autocast's cached bf16 weight casts of
           # every block were held through the forward (1.021 at the head's forward; Llama-3-70B tp 8:
           # 1.096); recompute.py drops them after each block (8 layers, a small vocabulary: casts matter)
           ("tp2-full-casts", 2, 0, {"parallel.tp": 2, "train.global_batch": 1, "train.activation_checkpointing": "full",
                                     "model.n_layer": 8, "model.vocab_size": 1024})]


@pytest.mark.parametrize("name,world,rank,ov", LAYOUTS, ids=[n for n, _, _, _ in LAYOUTS])
def test_traced_peak_equals_the_estimate(name, world, rank, ov):
    from zerotron.analysis.dryrun import dry_run

    rec = dry_run(tiny_config({**BASE, **ov}), world, ranks=[rank])[0]
    assert rec["peak_at"]["phase"] == ("finish_grads" if name.endswith("first-full") else "forward_backward"), \
        rec["peak_at"]
    assert abs(rec["ratios"]["peak"] - 1) <= 0.01, (name, rec["ratios"]["peak"], rec["peak_traced"], rec["estimated"])


# GPT-2 (LayerNorm, GELU) last pipeline stage at tp 2, a vocabulary tp does not divide (8,191): only the
# tp rank whose shard holds the padding column pads the loss's gradient (4 sbV/t more); the estimate
# had counted the padded copy on every tp rank (GPT-2-medium tp 8 x pp 4 last stage: 0.83-0.85)
GPT2 = {"model.arch": "gpt2", "model.n_layer": 2, "model.n_embd": 128, "model.n_head": 4, "model.vocab_size": 8191,
        "model.block_size": 256, "model.dropout": 0.0, "train.dtype": "bf16", "train.micro_batch": 1,
        "train.global_batch": 2, "parallel.tp": 2, "parallel.pp": 2, "parallel.zero_stage": 1}


def test_gpt2_last_stage_loss_padding_only_on_its_tp_rank():
    from zerotron.analysis.dryrun import dry_run

    for rec in dry_run(tiny_config(GPT2), 4, ranks=[2, 3]):  # last stage, tp ranks 0 and 1
        assert rec["coords"]["pp"] == 1 and rec["peak_at"]["phase"] == "forward_backward", rec["peak_at"]
        assert abs(rec["ratios"]["peak"] - 1) <= 0.01, (rec["coords"]["tp"], rec["ratios"]["peak"], rec["peak_traced"],
                                                         rec["estimated"])
