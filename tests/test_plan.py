"""The parallel plan (``zerotron.plan``): built once from the config, frozen, the only validation
layer; its derived sizes follow their definitions, and the strategies read nothing else."""
import dataclasses
import re
from pathlib import Path

import pytest

from zerotron.config import ConfigError
from zerotron.config_sections import Config, ParallelConfig, TrainConfig
from zerotron.plan import ParallelDims, ParallelPlan, build_plan
from zerotron.testing import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("world,over", [
    (1, {}),
    (4, {"parallel.tp": 2}),
    (4, {"parallel.pp": 2, "train.micro_batch": 1}),
    (8, {"parallel.pp": 2, "parallel.tp": 2, "parallel.zero_stage": 3, "train.micro_batch": 1,
         "parallel.microbatches": 2}),
    (2, {"parallel.pp_schedule": "interleaved", "parallel.virtual_stages": 2, "parallel.pp": 2,
         "train.micro_batch": 1}),
    (2, {"parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe", "parallel.virtual_stages": 2}),
    (4, {"parallel.dp_replicate": 2, "parallel.zero_stage": 2, "train.micro_batch": 1}),
    (2, {"parallel.zero_stage": 3, "parallel.zero_impl": "fsdp2"}),
    (2, {"parallel.tp": 2, "parallel.tp_impl": "dtensor"}),
    (2, {"parallel.dp_impl": "torch"}),
])
def test_derived_sizes_follow_their_definitions(world, over):
    cfg = tiny_config(over)
    plan = build_plan(cfg, world)
    p, t = cfg.parallel, cfg.train
    assert plan.world_size == world and plan.dp * plan.tp * plan.pp == world
    assert plan.dp == (p.dp or world // (p.tp * p.pp)) and plan.dp_shard * plan.dp_replicate == plan.dp
    assert plan.grad_accum * t.micro_batch * plan.dp == t.global_batch
    assert plan.flush_size == (p.microbatches or plan.grad_accum)
    pipelined = p.pp > 1 or p.pp_schedule == "interleaved"
    want_runner = p.pp_impl if p.pp_impl != "native" else ("pipeline" if pipelined else "plain")
    assert plan.runner == want_runner
    v = p.virtual_stages if p.pp_schedule == "interleaved" or p.pp_impl == "threads" else 1
    assert plan.n_model_stages == p.pp * v
    want_sync = ("dtensor_tp" if p.tp_impl == "dtensor" and p.tp > 1 else
                 ("zero" if p.zero_impl == "native" else "fsdp2") if p.zero_stage else
                 "ddp" if p.dp_impl == "native" else "torch_ddp")
    assert plan.sync == want_sync
    assert plan.layout() == {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "grad_accum": plan.grad_accum,
                             "dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "cp": 1}
    for f in dataclasses.fields(ParallelConfig):  # every setting reads as the config's (dp: resolved)
        if f.name != "dp":
            assert getattr(plan, f.name) == getattr(p, f.name), f.name
    for f in dataclasses.fields(TrainConfig):
        assert getattr(plan, f.name) == getattr(t, f.name), f.name
    assert plan.shape["n_layer"] == cfg.model.n_layer or cfg.model.n_layer == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.zero_stage = 1  # built once: nobody patches a plan afterwards
    before = plan.pp_schedule, plan.micro_batch
    p.pp_schedule, t.micro_batch = "zb-v", 999  # the plan holds copies of the sections
    assert (plan.pp_schedule, plan.micro_batch) == before


def test_defaults_are_the_configs_and_any_plan_is_valid():
    default, section = ParallelPlan(), ParallelConfig()
    for f in dataclasses.fields(ParallelConfig):
        if f.name != "dp":  # the resolved degree
            assert getattr(default, f.name) == getattr(section, f.name), f.name
    with pytest.raises(TypeError, match="degrees come from dims"):
        ParallelPlan(tp=2)
    assert (default.micro_batch, default.global_batch, default.seed) == (1, 0, 0)
    with pytest.raises(TypeError, match="'zero_stges' is not a parallel"):
        ParallelPlan(zero_stges=1)
    with pytest.raises(AttributeError):
        default.no_such_setting
    assert default.batch == default.micro_batch * default.dp and default.grad_accum == 1
    # constructing a plan directly runs the same rules as build_plan
    for fields, msg in [({"pp_schedule": "zigzag"}, "pp_schedule must be one of"),
                        ({"zero_stage": 1, "zero_impl": "fsdp2"}, "fsdp2 supports zero_stage 2"),
                        ({"dims": ParallelDims(8, 4, 1, 2, 2), "zero_stage": 3, "zero_impl": "fsdp2"},
                         "FSDP2's 2-D HSDP mesh is not split per stage"),
                        ({"dims": ParallelDims(2), "micro_batch": 3, "global_batch": 8}, "divisible by"),
                        ({"dims": ParallelDims(2, 1, 2, 1), "shape": {"n_layer": 2, "n_head": 3, "n_embd": 6,
                                                                    "block_size": 8}}, "must divide model.n_head")]:
        with pytest.raises(ConfigError, match=msg):
            ParallelPlan(**fields)
    # settings that only mean something in some layouts are refused elsewhere, never silently ignored
    for over, msg in [({"parallel.zero_impl": "fsdp2"}, "does nothing without a zero stage"),
                      ({"parallel.sequence_parallel": "true"}, "needs parallel.tp > 1"),
                      ({"parallel.tp_impl": "dtensor"}, "needs parallel.tp > 1"),
                      ({"parallel.microbatches": 2}, r"this layout has no pipeline \(parallel.pp 1\)")]:
        with pytest.raises(ConfigError, match=msg):
            build_plan(tiny_config(over), 1)
    with pytest.raises(ConfigError, match="does not equal the world size"):
        ParallelDims(4, 3, 1, 1)
    with pytest.raises(ConfigError, match=r"train\.lr must be > 0"):  # the value checks live here too
        build_plan(tiny_config({"train.lr": "0"}), 1)
    assert isinstance(build_plan(Config(), 1), ParallelPlan)


def test_the_strategies_read_the_plan_not_the_config():
    """No module of ``zerotron/parallel`` reads a config section: the plan is their only input."""
    offenders = []
    for f in sorted((ROOT / "zerotron" / "parallel").rglob("*.py")):
        text = f.read_text()
        for pat in (r"\bcfg\.(parallel|train|model)\b", r"from zerotron\.config(?:_sections)? import (?!ConfigError\b)",
                    r"\bvalidate\("):
            offenders += [f"{f.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(pat, text)]
    assert not offenders, offenders
