"""Split backward (pipeline.split_backward): B (input gradient) then W (weight gradients) gives the
fused backward's gradients bit for bit, accumulates through AccumulateGrad (hooks fire in W, never
in B; existing ``.grad`` buffers are added to in place), with and without recomputation. In-process,
fp64."""
import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from zerotron.parallel.pipeline.split_backward import backward_input, backward_weight


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(self.ln(x))))


def _fused_then_split(fn, params, x, grad_out, preset=None):
    """(reference grads, reference input grad, split grads, split input grad, hook counts)."""
    xi = x.clone().requires_grad_()
    out = fn(xi)
    g = grad_out(out)
    torch.autograd.backward(out, g)
    ref, ref_x = [q.grad.clone() if q.grad is not None else None for q in params], xi.grad.clone()
    for q in params:
        q.grad = None if preset is None else preset(q)
    fired = []
    hooks = [q.register_post_accumulate_grad_hook(lambda q: fired.append(id(q))) for q in params]
    ptrs = [q.grad.data_ptr() if q.grad is not None else None for q in params]
    xi = x.clone().requires_grad_()
    out = fn(xi)
    dx, work = backward_input(out, g, xi)
    after_b = list(fired)
    del out
    backward_weight(work)
    for h in hooks:
        h.remove()
    return ref, ref_x, dx, after_b, fired, ptrs


@pytest.mark.parametrize("recompute", [False, True])
def test_split_equals_fused_bitwise_and_hooks_fire_in_w(recompute):
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Block(), _Block()]).double()
    head = nn.Linear(8, 5).double()
    unused = nn.Linear(3, 3).double()  # not in the graph: ignored, keeps its (preset) gradient
    params = list(blocks.parameters()) + list(head.parameters()) + list(unused.parameters())

    def fn(h):
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False) if recompute else b(h)
        return head(h)

    x = torch.randn(4, 3, 8, dtype=torch.float64)
    ones = lambda q: torch.ones_like(q)  # noqa: E731  (a gradient buffer already holding values)
    ref, ref_x, dx, after_b, fired, ptrs = _fused_then_split(fn, params, x, torch.randn_like, preset=ones)
    assert torch.equal(dx, ref_x)
    assert after_b == []  # B accumulates nothing: no DDP bucket can fire before W
    used = params[:-2]
    assert sorted(fired) == sorted(id(q) for q in used)  # each used parameter exactly once, in W
    for q, r, p in zip(params, ref, ptrs):
        assert q.grad.data_ptr() == p  # added in place into the existing buffer (DDP/ZeRO-1 views)
        want = torch.ones_like(q) if r is None else torch.ones_like(q) + r
        assert torch.equal(q.grad, want)


def test_parameter_used_twice_and_shared_nodes():
    """A weight used twice on the input path (two captured nodes, one below the other) and a module
    whose output feeds two branches: no double counting."""
    torch.manual_seed(1)
    lin, ln, other = nn.Linear(6, 6).double(), nn.LayerNorm(6).double(), nn.Linear(6, 6).double()
    params = list(lin.parameters()) + list(ln.parameters()) + list(other.parameters())

    def fn(x):
        h = lin(torch.tanh(lin(x)))
        return ln(other(h) + 0.5 * h) * 2

    x = torch.randn(3, 6, dtype=torch.float64)
    ref, ref_x, dx, after_b, fired, _ = _fused_then_split(fn, params, x, torch.randn_like)
    assert after_b == [] and len(fired) == len(params)
    torch.testing.assert_close(dx, ref_x, rtol=1e-14, atol=0)
    for q, r in zip(params, ref):
        torch.testing.assert_close(q.grad, r, rtol=1e-13, atol=1e-15)


def test_no_differentiable_input_defers_the_whole_backward():
    """Model stage 0 (tokens in): B has no input gradient, W runs the whole backward."""
    emb, lin = nn.Embedding(10, 4).double(), nn.Linear(4, 1).double()
    params = list(emb.parameters()) + list(lin.parameters())
    tok = torch.tensor([[1, 2, 3]])
    loss = lin(emb(tok)).sum()
    dx, work = backward_input(loss, None, None)
    assert dx is None and all(q.grad is None for q in params)
    backward_weight(work)
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in params)
    ref = [q.grad.clone() for q in params]
    for q in params:
        q.grad = None
    lin(emb(tok)).sum().backward()
    assert all(torch.equal(q.grad, r) for q, r in zip(params, ref))
