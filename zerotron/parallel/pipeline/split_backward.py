"""A stage's backward split in two: B (gradient w.r.t. the stage input) and W (weight gradients).

Zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv
2401.10241) send the input gradient upstream as soon as it is known and run the weight gradients
later. Done on the autograd graph of the stage output, the idea torch.distributed.pipelining uses
(``stage_backward_input`` / ``stage_backward_weight``):

* :func:`backward_input` finds, from the output's graph, the nodes on a path output -> input that
  also lead to a parameter (a matmul's backward computes both the input and the weight gradient),
  hooks them to capture the gradients that flow into them, and runs ``torch.autograd.grad`` for
  the input only, ``retain_graph=True`` (each node computes only the outputs the input needs: the
  matmul's weight gradient is not computed here).
* :func:`backward_weight` resumes from those captured gradients with ``torch.autograd.backward``
  into the parameters, so the gradients are accumulated by autograd's own AccumulateGrad: ``.grad``
  views into flat buffers (DDP buckets, ZeRO-1) are added to in place and post-accumulate-grad hooks
  (DDP buckets) fire then, after W, exactly as after a fused backward. Nodes below a captured
  node that also lies below another captured node get the captured value instead of the sum of
  both (no double counting).

Activation recomputation (``torch.utils.checkpoint``, non-reentrant) works unchanged: each backward
pass recomputes what it unpacks (B and W recompute separately: more compute, same result).
A stage whose input needs no gradient (model stage 0: tokens) has nothing to split: B does
nothing and W runs the whole backward.
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["WeightWork", "backward_input", "backward_weight"]


class WeightWork:
    """What W needs after B: ``edges`` (GradientEdge of each captured node input slot), their
    ``grads`` and the ``params`` (leaf tensors) to accumulate into; or, when there was nothing to
    split (a stage without a differentiable input), the whole backward ``(output, grad_output)``."""

    def __init__(self, params, edges=(), grads=(), nodes=(), whole=None):
        self.params, self.edges, self.grads, self.nodes, self.whole = params, list(edges), list(grads), nodes, whole


def _node(t: torch.Tensor):
    """The autograd node of ``t``: its grad_fn, or for a leaf its AccumulateGrad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


def _parents(root) -> dict:
    """{node: nodes that feed gradient into it} over the graph under ``root``."""
    parents, seen, todo = defaultdict(list), {root}, deque([root])
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                parents[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return parents


def _upward(starts, parents, stop=frozenset()) -> tuple[set, set]:
    """Nodes reachable from ``starts`` towards the output (``parents`` edges), not crossing ``stop``;
    returns (reached, stop nodes met)."""
    reached, met, todo = set(starts), set(), deque(starts)
    while todo:
        for up in parents.get(todo.popleft(), ()):
            if up in stop:
                met.add(up)
            elif up not in reached:
                reached.add(up)
                todo.append(up)
    return reached, met


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, inp: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of ``output`` w.r.t. ``inp`` (same shape as ``inp``, e.g. (b, T, C)), given
    ``grad_output`` (shape of ``output``; None for a scalar loss), and the :class:`WeightWork` that
    :func:`backward_weight` needs for the gradients of ``params`` (this stage's parameters; ones
    absent from the graph are ignored). ``inp`` None or not requiring grad: returns (None, the
    whole backward deferred). Raises what ``torch.autograd.grad`` raises (e.g. a graph already
    freed)."""
    params = [q for q in params if q.requires_grad]
    if inp is None or not inp.requires_grad or output.grad_fn is None:
        return None, WeightWork(params, whole=(output, grad_output))
    root = output.grad_fn
    parents = _parents(root)
    input_path, _ = _upward([_node(inp)], parents)  # every node between output and input
    cut = set()
    for q in params:
        acc = _node(q)
        if acc in parents:
            cut |= _upward([acc], parents, stop=input_path)[1]
    nodes = list(cut)
    captured: dict = {}
    handles = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n in nodes]
    try:
        (dinp,) = torch.autograd.grad(output, inp, grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    edges, grads = [], []
    for n in nodes:
        for i, g in enumerate(captured.get(n, ())):
            if g is not None:
                edges.append(GradientEdge(n, i))
                grads.append(g)
    return dinp, WeightWork(params, edges, grads, {n: captured[n] for n in nodes if n in captured})


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameter gradients left by :func:`backward_input` into ``param.grad``
    (through AccumulateGrad: hooks fire, ``.grad`` buffers are added to in place) and free the
    graph. Shapes: each parameter's. Raises what ``torch.autograd.backward`` raises."""
    if work.whole is not None:
        out, grad = work.whole
        torch.autograd.backward(out, grad)
        work.whole = None
        return
    if not work.edges:
        return
    # a captured node reached again through another captured node takes its captured gradients
    handles = [n.register_prehook(lambda _g, g=g: g) for n, g in work.nodes.items()]
    try:
        torch.autograd.backward(work.edges, work.grads, inputs=[q for q in work.params])
    finally:
        for h in handles:
            h.remove()
    work.edges = work.grads = work.nodes = None
