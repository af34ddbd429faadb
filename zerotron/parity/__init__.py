"""The parity matrix: every layout the config space allows, generated, and trained against one process.

A *layout* is one value per factor of :data:`FACTORS` -- gradient sync (native DDP, torch DDP,
native ZeRO-1/2/3, FSDP2 stage 2/3), dp degree, tp degree, sequence parallelism, pp degree,
pipeline schedule (or "threads": the pp stages as worker threads of each process, GPipe,
``parallel.pp_impl = threads``), gradient accumulation (micro-batches per dp rank per step), the pipeline
split (``parallel.pp_split`` auto | even: on the matrix model "auto" gives 5,3 at pp 2 and 3,2,2,1
at pp 4, so it runs uneven stages), HSDP replicas (``parallel.dp_replicate``) and activation
checkpointing (``train.activation_checkpointing`` none | full: every block recomputed in backward). Options that cannot
matter are canonicalised away (sequence parallelism only with tp > 1, a schedule and a split only with
pp > 1), and at most :data:`MAX_WORLD` processes are used. :func:`all_layouts` enumerates the
full product; :func:`covering_layouts` picks a small set in which every pair of factor values
that occurs in some valid layout occurs at least once (a greedy pairwise covering array), and
:func:`joint_covering` one such array over every model family at once, the family one more factor
(the :data:`MUST` witnesses in the families :func:`witness_families` names).

Each layout trains :data:`STEPS` optimizer steps of the same global batch (:data:`GLOBAL_BATCH`
sequences) in float64 (``train.dtype = "fp64"``) through the real :class:`~zerotron.train.trainer.Trainer`,
with active gradient clipping and evaluation, and is compared with the single-process run of the
same configuration (:func:`reference`):

* losses, gradient norms and validation losses: relative error per step;
* final parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``) of the canonical,
  layout-independent state dict: norm-wise relative error per tensor,
  ``||a - b|| / ||b||``;
* every copy of one tensor (dp replicas, tp-replicated parameters on the tp ranks, the tied
  embedding on the first and last pipeline stage) bitwise equal on every rank;
* the dense model ``strategy.full_params()`` yields (evaluation, generation, export): the same
  bits on every rank, the training dtype, and the reference values (plain tensor parallelism
  yields its TP model, which decodes on its shards, and is checked through the canonical state).

Document masking (``data.doc_mask``) is not a factor: the :data:`DOC_MASK` witnesses (dp, tp + SP,
pp, cp ring / a2a / allgather) run once more with the masks on a corpus of short documents
(:func:`doc_corpus`), against a single-process reference with the masks. LoRA is not a factor
either: the :data:`LORA` witnesses (dp, ZeRO-1/3, FSDP2, tp +- SP, pp) train adapters
(:data:`LORA_TRAIN`) against a single-process LoRA reference; parameters the reference never
stepped (the frozen base) must stay bitwise the reference's.
Offload
(``train.offload``: optimizer, optimizer-disk, params) is not a factor either: the :data:`OFFLOAD`
witnesses run once more with their offload mode against the same reference.

In float64 the reassociation noise of a correct layout is ~1e-16 per operation, so the bound
:data:`FP64_RTOL` = 1e-10 holds on any CPU, while a wrong gradient (a missing sum, a race)
moves these numbers by >= 1e-7. Config validation decides which layouts run; every refused one
must be refused for a reason listed by :func:`expected_refusal` (and the test asserts both
directions), never trained silently wrong.
"""
from zerotron.parity.runs import (
                                  ERRORS,
                                  check,
                                  compare,
                                  markdown,
                                  parity_worst,
                                  read_progress,
                                  reference,
                                  run_jobs,
                                  run_many,
                                  train_layout,
)
from zerotron.parity.space import (
                                  DOC_MASK,
                                  FACTORS,
                                  FP64_RTOL,
                                  GLOBAL_BATCH,
                                  LORA,
                                  LORA_CI,
                                  LORA_TRAIN,
                                  MAX_WORLD,
                                  MODEL,
                                  MODELS,
                                  MOE_MODEL,
                                  MOE_MUST,
                                  MOE_MUST_FULL,
                                  MUST,
                                  OFFLOAD,
                                  STEPS,
                                  TORCH_KINDS,
                                  TRAIN,
                                  Layout,
                                  all_layouts,
                                  config_for,
                                  covering_layouts,
                                  doc_corpus,
                                  doc_mask_layouts,
                                  expected_refusal,
                                  joint_covering,
                                  lora_layouts,
                                  moe_expected_refusal,
                                  moe_layouts,
                                  moe_refusal,
                                  offload_layouts,
                                  refusal,
                                  witness_families,
)

__all__ = ["ERRORS", "check", "compare", "markdown", "read_progress", "parity_worst", "reference", "run_jobs", "run_many", "train_layout", "DOC_MASK", "FACTORS",
           "FP64_RTOL", "GLOBAL_BATCH", "MAX_WORLD", "MODEL", "MODELS", "MUST", "STEPS", "TORCH_KINDS", "TRAIN",
           "Layout", "all_layouts", "config_for", "covering_layouts", "joint_covering", "witness_families", "doc_corpus", "doc_mask_layouts", "expected_refusal", "refusal",
           "MOE_MODEL", "MOE_MUST", "MOE_MUST_FULL", "moe_layouts", "moe_refusal", "moe_expected_refusal",
           "LORA", "LORA_CI", "LORA_TRAIN", "lora_layouts",
           "OFFLOAD", "offload_layouts"]
