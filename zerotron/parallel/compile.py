"""Regional compilation as a transform: ``train.compile = true``.

Each repeated block of the model (``model.layout().blocks``) runs its forward through
``torch.compile`` (TorchDynamo captures the graph, AOTAutograd derives the backward, Inductor
generates the kernels: C++/OpenMP on CPU, Triton on CUDA; Ansel et al. 2024, "PyTorch 2"). All
blocks share one compiled entry (their code is the same and their parameters are graph inputs), so
the model compiles once whatever its depth -- *regional* compilation, the way torchtitan composes
compile with FSDP2 and tensor parallelism.

Where it sits in ``parallelize``'s order: after tensor/context parallelism and activation
checkpointing (step 2b), before the runner and the gradient synchroniser. Only the block's
``forward`` is compiled, never ``Module.__call__``, so everything the strategies attach to the
block module stays eager and runs exactly as without compilation: ZeRO-3's and FSDP2's
gather/free forward hooks around each block, DDP's gradient-bucket hooks (on the parameters,
fired by AOTAutograd's backward through AccumulateGrad), a pipeline's split backward (B and W
each run the compiled backward node; W runs it again from the captured gradients with
``retain_graph``: same values, more compute; AOTAutograd's donated buffers are therefore turned
off). Inside the compiled region:

* tensor / sequence parallelism's f/g operators (``parallel.tensor.ops``: autograd Functions
  around gloo/NCCL collectives with byte accounting) are *graph breaks by design*
  (``ops.opaque_to_compiler``: ``torch.compiler.disable``): Dynamo splits the block around each
  collective, runs it eagerly and compiles the pieces between (counted as ``graph_breaks``).
  Traced, the Python byte counters became guards that failed at every call (a recompile per call);
* activation checkpointing (``torch.utils.checkpoint``, non-reentrant) is traced as a higher-order
  op and recomputed by the compiled backward;
* dropout draws from the same generator; fp64/fp32/bf16 autocast are traced as they are.

Shapes are static (``dynamic=False``: no symbolic shapes, the cheapest compile). Training: the plan
fixes every micro-batch at (micro_batch, block_size / (sp x cp)) tokens, so the training entry
compiles once. Evaluation (no gradient: a different graph without saved activations) has its own
compiled entry, compiled at the first evaluation; the trainer pads every validation batch to
micro_batch rows (``train.setup.pad_rows``: rows without targets, no loss counted), so a short
last batch or a padding batch does not recompile. Another shape (a caller's own batch) compiles
once more and shows in ``recompiles``. Under tensor parallelism the frames after each graph break
(Dynamo's resume functions, and module forwards entered from them) are compiled on their own:
they compile once per distinct shape (q vs k/v projections of grouped-query attention) and once
more for evaluation, all during the first step; ``recompiles`` counts them and stays flat after it
(the tests assert so). Decoding with a KV cache (generation, serving) runs the eager forward.

:func:`compile_stats` reads Dynamo's counters for the metrics (``graph_breaks``, ``recompiles``,
``compile_time_s``). Inductor's caches are process-wide; the trainer points them at a directory
(``TORCHINDUCTOR_CACHE_DIR``, see :func:`use_cache_dir`) so the other ranks and a resumed run reuse
them.
"""
from __future__ import annotations

import os

import torch

from zerotron.models.layout import get_module
from zerotron.parallel.tensor import ops as tensor_ops

__all__ = ["apply_compile", "compile_stats", "use_cache_dir"]


def _train_entry(forward, x):
    return forward(x)


def _eval_entry(forward, x):
    return forward(x)


_compiled: dict = {}


def _entries(mode: str | None):
    """The two compiled entries (training, evaluation), created once per process and mode: every
    block of every model of this process shares them (one cache entry each)."""
    if mode not in _compiled:
        import torch._dynamo.config
        import torch._functorch.config
        # never silently eager: past the recompile limit Dynamo would fall back to the eager frame;
        # raise instead (a run compiles 1-2 graphs per entry; tests of many layouts in one process more)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # a zero-bubble pipeline runs each compiled backward twice (B, then W with retain_graph):
        # AOTAutograd's donated buffers (freed by the first backward) forbid that; off for every
        # layout, since the compiled entry is shared by every model of the process
        torch._functorch.config.donated_buffer = False
        tensor_ops.opaque_to_compiler()  # tp/SP collectives: graph breaks, run eagerly (never traced)
        _compiled[mode] = (torch.compile(_train_entry, mode=mode, dynamic=False),
                           torch.compile(_eval_entry, mode=mode, dynamic=False))
    return _compiled[mode]


def _wrap(forward, mode):
    train, evaluate = _entries(mode)

    def compiled_forward(x, kv_cache=None):
        if kv_cache is not None:  # decoding: a Python cache object and a growing length, eager
            return forward(x, kv_cache)
        return train(forward, x) if torch.is_grad_enabled() else evaluate(forward, x)
    compiled_forward.eager = forward
    return compiled_forward


def apply_compile(model, enabled: bool, mode: str | None = None):
    """Compile the forward of every block of ``model`` (``model.layout().blocks``, each mapping
    (B, T, C) -> (B, T, C)) in place when ``enabled``; ``mode`` is ``torch.compile``'s (None =
    default; "reduce-overhead" uses CUDA graphs on CUDA). Parameter names, state dicts and
    checkpoints are unchanged (the block *instance*'s ``forward`` is replaced, as activation
    checkpointing does). Returns ``model``. Raises nothing itself; a combination that cannot be
    compiled is refused by ``zerotron.plan`` before this runs."""
    if not enabled:
        return model
    for block in get_module(model, model.layout().blocks):
        block.forward = _wrap(block.forward, mode)
    return model


def compile_stats() -> dict:
    """This process's compilation so far, from TorchDynamo's counters: ``graph_breaks`` (graph
    breaks traced, e.g. at tensor-parallel collectives), ``recompiles`` (cache entries beyond the
    first of every frame Dynamo compiled -- the entries and the resume functions after graph
    breaks: each is a guard that failed, e.g. a new shape), ``graphs`` (distinct
    graphs compiled) and ``compile_time_s`` (seconds in Dynamo tracing + AOTAutograd + Inductor,
    forward and backward). All zero when nothing was compiled."""
    from torch._dynamo.convert_frame import input_codes
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import compilation_time_metrics, counters

    # every frame Dynamo has seen: the two entries and the resume functions after graph breaks
    codes = [c for c in (ref() for ref in list(input_codes.seen)) if c is not None]
    entries = [len(_debug_get_cache_entry_list(c)) for c in codes]
    secs = sum(sum(v) for k, v in compilation_time_metrics.items()
               if k == "_compile.compile_inner" or k.endswith("bw_compiler"))
    return {"graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(max(n - 1, 0) for n in entries)),
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "compile_time_s": round(float(secs), 3)}


def use_cache_dir(path: str) -> None:
    """Point Inductor's on-disk caches (FX graph cache, AOTAutograd cache, generated C++/Triton
    code) at ``path`` unless ``TORCHINDUCTOR_CACHE_DIR`` is already set, so every rank of a host
    and a resumed run reuse what the first compile produced. Call before the first compile."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(path))
