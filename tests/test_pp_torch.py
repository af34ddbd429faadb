"""The torch.distributed.pipelining backend (``parallel.pp_impl = "torch"``): config refusals (one line
each), the schedule table and the bench layouts. Training parity runs in the parity matrix (schedule
factor values torch-gpipe, torch-1f1b, torch-interleaved, torch-zb; MUST witnesses over dp 2)."""
import pytest

from zerotron import parity
from zerotron.bench.layouts import get_layout
from zerotron.config import ConfigError
from zerotron.plan import build_plan
from zerotron.testing import tiny_config

TORCH = {"parallel.pp_impl": "torch", "parallel.pp": 2}


@pytest.mark.parametrize("over, world, msg", [
    ({"parallel.pp": 1}, 1, "needs parallel.pp >= 2"),
    ({"parallel.pp_schedule": "naive"}, 2, "runs gpipe, 1f1b, interleaved or zb-h1, not 'naive'"),
    ({"parallel.pp_schedule": "zb-v", "parallel.virtual_stages": 2}, 2, r"not 'zb-v' \(zb-v runs on pp_impl = native\)"),
    ({"parallel.zero_stage": 1}, 4, "only with native DDP"),
    ({"parallel.tp": 2}, 4, "only with native DDP"),
    ({"parallel.dp_impl": "torch"}, 4, "only with native DDP"),
    ({"parallel.pp_schedule": "1f1b", "parallel.microbatches": 1}, 2, r"micro-batches per flush \(1\) >= pp \(2\)"),
    ({"parallel.pp_impl": "torchx"}, 2, "must be native, threads or torch"),
])
def test_torch_pipeline_refusals(over, world, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        build_plan(tiny_config({**TORCH, **over}), world)
    assert "\n" not in str(e.value)


def test_torch_pipeline_accepted_layouts_and_schedule_table():
    from torch.distributed.pipelining import schedules as ts

    from zerotron.parallel.pipeline.torch_backend import TORCH_SCHEDULES

    assert set(TORCH_SCHEDULES) == set(parity.TORCH_KINDS.values())
    for cls, multi in TORCH_SCHEDULES.values():
        assert getattr(ts, cls.__name__) is cls
        assert multi == issubclass(cls, ts.PipelineScheduleMulti)
    for kind in ("gpipe", "1f1b", "zb-h1"):
        build_plan(tiny_config({**TORCH, "parallel.pp_schedule": kind}), 2)
    build_plan(tiny_config({**TORCH, "parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2}), 2)
    for name in ("pp-torch-gpipe", "pp-torch-1f1b", "pp-torch-interleaved", "pp-torch-zb"):
        lay = get_layout(name + "-mb2")
        assert lay.overrides["parallel.pp_impl"] == "torch"
        assert str(lay.overrides["train.micro_batch"]) == "2"
    # every torch schedule has a MUST witness in the covering array
    assert {n.split("-pp2-")[1].rsplit("-acc", 1)[0] for n in parity.MUST if "-torch-" in n} == set(parity.TORCH_KINDS)
