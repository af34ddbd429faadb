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
  (DDP buckets) fire then, after W, exactly as after a fused backward. One call per parameter
  group (the parameters leaving the input path at the same nodes), into that group only, so the
  input path is not run again.

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
    """What W needs after B: ``groups``, a list of (edges, grads, params, nodes) -- the GradientEdge
    of each captured node input slot, the gradients captured there, the parameters (leaf tensors)
    they lead to, and {node: captured gradients} of the group's nodes; or, when there was nothing
    to split (a stage without a differentiable input), the whole backward ``whole = (output,
    grad_output)``."""

    def __init__(self, groups=(), whole=None):
        self.groups, self.whole = list(groups), whole


def _parents(root) -> tuple[dict, dict]:
    """({node: nodes that feed gradient into it}, {id(leaf tensor): its AccumulateGrad node}) over
    the graph under ``root``."""
    parents, leaves, seen, todo = defaultdict(list), {}, {root}, deque([root])
    while todo:
        node = todo.popleft()
        nxts = node.next_functions
        if not nxts and type(node).__name__ == "AccumulateGrad":  # the node of a leaf tensor
            leaves[id(node.variable)] = node
        for nxt, _ in nxts:
            if nxt is not None:
                parents[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return parents, leaves


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


def _groups(params, parents, leaves, input_path) -> list[tuple[list, list]]:
    """Parameters grouped by the input-path nodes ("cut" nodes) their gradients leave from: two
    parameters of one node (a matmul's weight and bias) share a group, and so does everything a
    parameter with several uses touches. Returns [(params, cut nodes)]."""
    groups: list[tuple[list, set]] = []
    for q in params:
        acc = leaves[id(q)]
        cut = _upward([acc], parents, stop=input_path)[1]
        merged = [g for g in groups if g[1] & cut]
        groups = [g for g in groups if not g[1] & cut]
        groups.append(([q] + [x for g in merged for x in g[0]], cut.union(*(g[1] for g in merged))))
    return [(ps, list(cut)) for ps, cut in groups]


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None,
                   inp: torch.Tensor | None) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of ``output`` w.r.t. ``inp`` (same shape as ``inp``, e.g. (b, T, C)), given
    ``grad_output`` (shape of ``output``; None for a scalar loss), and the :class:`WeightWork` that
    :func:`backward_weight` needs for the weight gradients: those of every leaf tensor of the
    output's graph other than ``inp``, i.e. the parameter objects the forward computed with (for
    FSDP2 its unsharded parameters, which are not the module's sharded ones). ``inp`` None or not
    requiring grad: returns (None, the whole backward deferred). Raises what
    ``torch.autograd.grad`` raises (e.g. a graph already freed)."""
    if inp is None or not inp.requires_grad or output.grad_fn is None:
        return None, WeightWork(whole=(output, grad_output))
    parents, leaves = _parents(output.grad_fn)
    if id(inp) not in leaves:
        raise ValueError("the stage output does not depend on the stage input")
    input_path, _ = _upward([leaves[id(inp)]], parents)  # every node between output and input
    params = [n.variable for k, n in leaves.items() if k != id(inp)]  # graph order: deterministic
    groups = _groups(params, parents, leaves, input_path)
    nodes = {n for _, cut in groups for n in cut}
    captured: dict = {}
    handles = [n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n in nodes]
    try:
        (dinp,) = torch.autograd.grad(output, inp, grad_output, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    work = []
    for ps, cut in groups:
        edges, grads = [], []
        for n in cut:
            for i, g in enumerate(captured.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(g)
        if edges:
            work.append((edges, grads, ps, {n: captured[n] for n in cut if n in captured}))
    return dinp, WeightWork(work)


def backward_weight(work: WeightWork) -> None:
    """W: accumulate the parameter gradients left by :func:`backward_input` into ``param.grad``
    (through AccumulateGrad: hooks fire, ``.grad`` buffers are added to in place) and free the
    graph. One ``torch.autograd.backward`` per parameter group, from its captured nodes into its
    parameters only, so no input-path node runs again (except between the nodes of a parameter
    used several times, where each captured node takes its captured gradients, not their sum
    with what flows in again). Shapes: each parameter's. Raises what ``torch.autograd.backward``
    raises."""
    if work.whole is not None:
        out, grad = work.whole
        work.whole = None
        torch.autograd.backward(out, grad)
        return
    groups, work.groups = work.groups, []
    for edges, grads, ps, nodes in groups:
        handles = [n.register_prehook(lambda _g, g=g: g) for n, g in nodes.items()] if len(nodes) > 1 else []
        try:
            torch.autograd.backward(edges, grads, inputs=ps)
        finally:
            for h in handles:
                h.remove()
