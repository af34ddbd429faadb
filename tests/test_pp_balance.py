"""Balanced pipeline stages (``parallel.pp_split = "auto"``) and the bubble accounting (simulator fed
with per-stage times). Pure arithmetic plus one in-process PipelineStrategy; no spawns (the
parity of uneven splits is in the generated matrix, factor ``split``)."""
import itertools
import random

import pytest

from zerotron.parallel.pipeline.accounting import merge_stage_times, predicted_bubble
from zerotron.parallel.pipeline.schedules import build_schedule
from zerotron.parallel.pipeline.simulation import bubble_theory, rank_idle_fractions, simulate
from zerotron.plan import ParallelPlan
from zerotron.stages import (
    Placement,
    balanced_counts,
    balanced_counts_v,
    even_counts,
    stage_costs,
    stage_layer_counts,
    v_rank_costs,
)


def _brute_minimax(costs, k, first, last):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = [0, *cuts, n]
        v = max(stage_costs([b[i + 1] - b[i] for i in range(k)], costs, first, last))
        best = v if best is None else min(best, v)
    return best


def test_balanced_counts_is_the_minimax_partition():
    rng = random.Random(0)
    for _ in range(600):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([1.0, 2.0, rng.random() * 3]) for _ in range(n)]
        first, last = rng.choice([0.0, rng.random() * 4]), rng.choice([0.0, 2.33, rng.random() * 5])
        got = balanced_counts(costs, k, first, last)
        assert len(got) == k and min(got) >= 1 and sum(got) == n, got
        assert max(stage_costs(got, costs, first, last)) == pytest.approx(_brute_minimax(costs, k, first, last),
                                                                         rel=1e-12, abs=1e-12)
    # the equal split stays whenever it is optimal; otherwise the most even optimal split
    assert balanced_counts([1.0] * 8, 4, 0.0, 0.2) == [2, 2, 2, 2] == even_counts(8, 4)
    assert balanced_counts([1.0] * 8, 4, 0.0, 1.0) == [2, 2, 2, 2]  # [3,2,2,1] ties at 3: even kept
    assert balanced_counts([1.0] * 4, 2, 0.0, 2.33) == [3, 1]
    assert balanced_counts([1.0] * 8, 4, 0.0, 1.33) == [3, 2, 2, 1]  # not [3,3,1,1]: same max, less even
    assert balanced_counts([1.0] * 8, 2, 3.0, 0.0) == [3, 5]  # a heavy first stage gives layers away
    with pytest.raises(ValueError, match="at least one layer"):
        balanced_counts([1.0], 2)
    with pytest.raises(ValueError, match=">= 0"):
        balanced_counts([1.0, -1.0], 2)


def test_balanced_counts_v_balances_each_ranks_pair():
    """ZB-V: rank r runs stages r and 2p-1-r. 8 unit blocks, a head of 2.3 blocks, p = 2: the
    stage-balanced split puts 3 + 1 blocks + the head on rank 0 (6.3 vs 4); the V-aware one gives
    rank 0 three blocks and the head (5.3) and rank 1 five (5.0), the best any split can do (rank 0
    always carries the head: with 2 blocks it is 4.3 but rank 1 then has 6)."""
    blocks = [1.0] * 8
    stage = balanced_counts(blocks, 4, 0.0, 2.3)
    assert max(v_rank_costs(stage_costs(stage, blocks, 0.0, 2.3))) == pytest.approx(6.3)
    got = balanced_counts_v(blocks, 4, 0.0, 2.3)
    assert got[0] + got[3] == 3 and sum(got) == 8 and min(got) >= 1
    assert v_rank_costs(stage_costs(got, blocks, 0.0, 2.3)) == pytest.approx([5.3, 5.0])
    assert stage_layer_counts(8, 4, "auto", (blocks, 0.0, 2.3), Placement(2, 2, "v")) == got
    # never worse than the stage-balanced split, per rank; random costs, p = 2 and 3
    rng = random.Random(0)
    for _ in range(30):
        n, S = rng.randint(6, 12), rng.choice([4, 6])
        if n < S:
            continue
        b = [rng.uniform(0.5, 2.0) for _ in range(n)]
        first, last = rng.uniform(0, 1), rng.uniform(0, 4)
        v = balanced_counts_v(b, S, first, last)
        ref = balanced_counts(b, S, first, last)
        assert max(v_rank_costs(stage_costs(v, b, first, last))) <= max(v_rank_costs(stage_costs(ref, b, first, last))) + 1e-12
    with pytest.raises(ValueError, match="even number of model stages"):
        balanced_counts_v(blocks, 3)


def test_explicit_split_needs_a_pipeline():
    from zerotron.config import ConfigError
    from zerotron.plan import build_plan
    from zerotron.testing import tiny_config

    with pytest.raises(ConfigError, match=r"parallel.pp_split = '3,1' splits layers over pipeline stages, but "
                                          r"parallel.pp = 1"):
        build_plan(tiny_config({"parallel.pp_split": "3,1"}), 1)
    for word in ("auto", "even", ""):
        build_plan(tiny_config({"parallel.pp_split": word}), 1)


def test_stage_layer_counts_words():
    assert stage_layer_counts(8, 3, "even") == stage_layer_counts(8, 3, "") == [3, 3, 2]
    assert stage_layer_counts(4, 2, "auto", ([1.0] * 4, 0.0, 2.33)) == [3, 1]
    assert stage_layer_counts(4, 2, " 1,3 ") == [1, 3]
    for args, msg in [((4, 2, "auto"), "needs per-layer cost"), ((4, 2, "auto", ([1.0] * 3, 0, 0)), "3 block costs"),
                      ((4, 2, "bogus"), "auto, even or comma-separated"), ((1, 2, "auto", ([1.0], 0, 0)), "at least one")]:
        with pytest.raises(ValueError, match=msg):
            stage_layer_counts(*args)


def test_layer_costs_from_flops_every_family(single_process, capsys):
    """Block cost = 2 x matmul weights + 4*T*C (PaLM appendix B forward), checked against the
    closed-form parameter counts of ``analysis.flops`` (an independent count) for GPT-2 and Llama;
    head = 2*C*V + 5*V; the auto split of the default model is 3,1 and is announced once."""
    import torch

    from zerotron.analysis.flops import shape_of
    from zerotron.config_sections import Config
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.models.llama import Llama, LlamaConfig
    from zerotron.parallel.pipeline.balance import layer_costs, resolve_split, split_message
    from zerotron.parallel.pipeline.runner import PipelineStrategy

    gcfg = GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=4, n_embd=128)
    lcfg = LlamaConfig(vocab_size=1000, block_size=32, n_layer=6, n_head=4, n_kv_head=2, n_embd=64,
                       intermediate_size=176)
    for cls, cfg in ((GPT, gcfg), (Llama, lcfg)):
        model = cls(cfg)
        blocks, first, last = layer_costs(model)
        shape = shape_of(cfg)
        c, v, t = shape.n_embd, shape.vocab_size, shape.block_size
        assert blocks == [2 * shape.block_matmul_params() + 4 * t * c] * cfg.n_layer, cls
        assert first == 2 * c and last == 2 * c * v + 5 * v
        full, _, _ = layer_costs(model, "full")
        sel, _, _ = layer_costs(model, "selective")
        assert full[0] == pytest.approx(blocks[0] * 4 / 3) and blocks[0] < sel[0] < full[0]
    gpt = GPT(gcfg)
    b, _, h = layer_costs(gpt)
    assert h / b[0] == pytest.approx((2 * 128 * 4096 + 5 * 4096) / (24 * 128**2 + 4 * 128 * 128))  # 2.33 blocks
    assert resolve_split(gpt, 2, "auto") == [3, 1] and resolve_split(gpt, 2, "even") == [2, 2]
    assert resolve_split(gpt, 2, "1,3") == [1, 3] and resolve_split(gpt, 4, "auto") == [1, 1, 1, 1]
    assert "layers per stage 3,1" in split_message(gpt, [3, 1], "auto")
    assert "the even split 2,2" in split_message(gpt, [3, 1], "auto")
    with pytest.raises(ValueError, match="recompute must be"):
        layer_costs(gpt, "some")
    # the strategy uses it (pp == 1, interleaved: 2 model stages on this rank) and rank 0 prints it once
    mesh = Mesh(ParallelDims(1, 1, 1, 1), torch.device("cpu"))
    cfg = Config()
    cfg.parallel.pp_schedule, cfg.parallel.virtual_stages = "interleaved", 2
    capsys.readouterr()
    for _ in range(2):
        s = PipelineStrategy(GPT(gcfg), mesh, ParallelPlan.from_config(cfg, mesh.dims))
        assert s.split == [3, 1] and [list(r) for r in s.module.layer_ranges] == [[0, 1, 2], [3]]
    out = capsys.readouterr().out
    assert out.count("zerotron: pipeline split (parallel.pp_split = auto): layers per stage 3,1") == 1, out
    cfg.parallel.pp_split = "even"
    assert PipelineStrategy(GPT(gcfg), mesh, ParallelPlan.from_config(cfg, mesh.dims)).split == [2, 2] and "pipeline split" not in capsys.readouterr().out


def test_simulate_per_stage_costs_and_rank_idle():
    p, m = 2, 8
    sched = build_schedule(p, m, "1f1b")
    uniform = simulate(sched, p)
    assert rank_idle_fractions(uniform)[0] == pytest.approx(bubble_theory(p, m))  # rank 0 walks the makespan
    same = simulate(sched, p, 1, [1.0, 1.0], [2.0, 2.0])
    assert same.intervals == uniform.intervals
    slow_last = simulate(sched, p, 1, [1.0, 1.5], [2.0, 3.0])
    assert slow_last.makespan == pytest.approx(m * 4.5 + 3.0)  # bottleneck stage busy m x 4.5, plus stage 0's F and B
    assert rank_idle_fractions(slow_last)[0] > bubble_theory(p, m) + 0.15
    inter = build_schedule(2, 4, "interleaved", 2)  # per-stage lists are per model stage (not divided by v)
    assert simulate(inter, 2, 2, [0.5] * 4, [1.0] * 4).intervals == simulate(inter, 2, 2).intervals
    with pytest.raises(ValueError, match="one cost per model stage"):
        simulate(sched, p, 1, [1.0, 1.0, 1.0])


def test_predicted_bubble_from_stage_times():
    merged = merge_stage_times([{"F": {0: 1.0}, "B": {0: 2.0}}, {"F": {1: 1.0}, "B": {1: 1.0}},
                                {"F": {1: 2.0}, "B": {1: 3.0}}])  # stage 1 on two dp replicas: averaged
    assert merged == {"F": {0: 1.0, 1: 1.5}, "B": {0: 2.0, 1: 2.0}}
    even = predicted_bubble(2, 8, "1f1b", 1, {"F": {0: 1.0, 1: 1.0}, "B": {0: 2.0, 1: 2.0}})
    assert even["max"] == pytest.approx(1 / 9) and even["mean"] == pytest.approx(1 / 9)
    assert even["makespan_s"] == pytest.approx(27.0)
    heavy = predicted_bubble(2, 8, "1f1b", 1, {"F": {0: 1.0, 1: 2.0}, "B": {0: 2.0, 1: 4.0}})
    assert heavy["max"] > 0.4 and heavy["per_rank"][0] == heavy["max"]
    gp = predicted_bubble(4, 4, "gpipe", 1, {k: {s: c for s in range(4)} for k, c in (("F", 1.0), ("B", 2.0))})
    assert gp["per_rank"][0] == pytest.approx(bubble_theory(4, 4))
    with pytest.raises(ValueError, match=r"no measured F time for model stage\(s\) \[1\]"):
        predicted_bubble(2, 2, "1f1b", 1, {"F": {0: 1.0}, "B": {0: 1.0, 1: 1.0}})


def _tp_costs():
    """In each of 2 ranks: layer costs of the GPT-2 and Llama test models, dense and tp=2-sharded."""
    import torch
    import torch.distributed as dist

    from zerotron.distributed import comm
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.models.llama import Llama, LlamaConfig
    from zerotron.parallel.pipeline.balance import layer_costs, resolve_split
    from zerotron.parallel.tensor.transform import apply_tensor_parallel

    group = comm.NamedGroup(dist.group.WORLD, "tp")
    out = []
    for model in (GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=4, n_head=2, n_embd=32)),
                  Llama(LlamaConfig(vocab_size=1000, block_size=16, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
                                    intermediate_size=64))):
        torch.manual_seed(0)
        dense = layer_costs(model)
        tp = apply_tensor_parallel(model, group)
        out.append((dense, layer_costs(tp), resolve_split(tp, 2, "auto")))
    return out


def test_layer_costs_do_not_depend_on_tp():
    """Tensor-parallel shards count at their dense size, so every tp rank picks the dense split."""
    from zerotron.testing import run_ranks

    for per_rank in run_ranks(_tp_costs, 2):
        for dense, sharded, split in per_rank:
            assert sharded == dense and split == [3, 1], (dense, sharded, split)
