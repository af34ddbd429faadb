"""``train.optimizer_impl`` (fused | foreach | loop, ``parallel.optim.impl_kwargs``): each builds the
AdamW torch runs with that kernel, the three agree to a few ulps of each tensor's scale after several steps (fp64 and fp32,
per-parameter tensors and ZeRO-style flat buffers), and a bad name is refused by the plan in one
line. Speed: ``python benchmarks/optimizer_step.py`` (not a test)."""
import pytest
import torch

from zerotron.config import ConfigError
from zerotron.config_sections import TrainConfig
from zerotron.models import registry
from zerotron.parallel.optim import IMPLS, build_optimizer, decay_mask
from zerotron.plan import build_plan
from zerotron.testing import tiny_config


def _steps(impl: str, dtype, flat: bool, n: int = 5):
    torch.manual_seed(0)
    model = registry.build_model(registry.preset_config("tiny", vocab_size=97, block_size=16)).to(dtype)
    mask = decay_mask(model)
    ps = list(model.parameters())
    if flat:
        groups = [[p for p in ps if mask[id(p)]], [p for p in ps if not mask[id(p)]]]
        ps = [torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in g])) for g in groups]
        mask = {id(ps[0]): True, id(ps[1]): False}
    opt = build_optimizer(ps, mask, TrainConfig(optimizer_impl=impl, lr=1e-2))
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
        opt.step()
    return opt, [p.detach() for p in ps]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_impls_agree_within_ulps(dtype):
    eps = torch.finfo(dtype).eps
    for flat in (False, True):
        ref_opt, ref = _steps("loop", dtype, flat)
        assert all(not g["fused"] and not g["foreach"] for g in ref_opt.param_groups)
        for impl in ("fused", "foreach"):
            opt, got = _steps(impl, dtype, flat)
            assert all(g[impl] for g in opt.param_groups)
            # per tensor, relative to its largest value (elementwise ratios blow up where a value is near 0)
            worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))
            assert worst <= 16 * eps, (impl, flat, worst / eps)
            assert worst == 0 or impl != "loop"


def test_default_and_refusal():
    assert TrainConfig().optimizer_impl == "fused" and IMPLS == ("fused", "foreach", "loop")
    with pytest.raises(ConfigError, match="train.optimizer_impl must be fused, foreach or loop"):
        build_plan(tiny_config({"train.optimizer_impl": "adam8bit"}), 1)
