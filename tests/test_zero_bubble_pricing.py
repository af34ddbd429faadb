"""zerotron plan / zerotron memory price the zero-bubble schedules (zb-h1, zb-v): every bubble and
activation-peak formula the estimators use is checked against the schedule simulator."""
import json

import pytest

from zerotron.analysis.activations import _cap, _in_flight_states, activation_bytes
from zerotron.analysis.bubble import _simulated_idle, bubble_fraction, pipeline_idle
from zerotron.analysis.cost_model import CostModel
from zerotron.analysis.hardware import hardware
from zerotron.analysis.layout_cost import evaluate
from zerotron.analysis.memory import preset_config
from zerotron.analysis.memory_cli import memory_main
from zerotron.analysis.planner import plan
from zerotron.parallel.pipeline.schedules import build_schedule
from zerotron.parallel.pipeline.simulation import simulate

KINDS = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2))


def _sim(pp, m, kind, v, costs=(1.0, 1.0, 1.0)):
    return simulate(build_schedule(pp, m, kind, v), pp, v, *costs, eager_sends=True)


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_bubble_equals_the_simulator_at_unit_costs(pp):
    for kind, v in KINDS:
        for m in sorted({1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp + 1, 4 * pp} - {0}):
            if kind == "interleaved" and m % pp:
                continue
            res = _sim(pp, m, kind, v)
            assert pipeline_idle(pp, m, kind, v) == pytest.approx(max(res.idle), abs=1e-9), (kind, pp, m)
            assert bubble_fraction(pp, m, kind, v) == pytest.approx(res.bubble_fraction, abs=1e-9), (kind, pp, m)


@pytest.mark.parametrize("costs", [(0.3, 0.45, 0.25), (0.25, 0.35, 0.4), (1.0, 2.0, 0.0)])
def test_zero_bubble_idle_at_unequal_costs(costs):
    for pp in (2, 3, 4):
        for m in (pp, 2 * pp + 1, 5 * pp):
            for kind, v in KINDS[1:]:
                if kind == "interleaved" and m % pp:
                    continue
                want = max(_sim(pp, m, kind, v, costs).idle)
                assert pipeline_idle(pp, m, kind, v, *costs) == pytest.approx(want, abs=1e-9), (kind, pp, m, costs)


def test_zb_v_extrapolation_beyond_8pp_is_within_a_hundredth():
    for pp, m in ((2, 40), (3, 100), (4, 41), (5, 47)):
        for costs in ((1.0, 1.0, 1.0), (0.3, 0.45, 0.25)):
            exact = _simulated_idle(pp, m, "zb-v", *costs)
            busy = m * sum(costs)
            est = pipeline_idle(pp, m, "zb-v", 2, *costs)
            assert abs(est / (est + busy) - exact / (exact + busy)) < 0.01, (pp, m, costs)


def test_zero_bubble_ordering_and_the_synchronous_step_bound():
    # T_F = T_B = T_W: ZB-H1 idles a third of 1F1B; ZB-V between (p-1)T_F/2 and 1.71 times it
    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 3 * pp):
            one = pipeline_idle(pp, m, "1f1b")
            assert pipeline_idle(pp, m, "zb-h1") == pytest.approx(one / 3)
            bound = (pp - 1) / 2
            assert bound - 1e-9 <= pipeline_idle(pp, m, "zb-v", 2) <= 1.72 * bound


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_activation_peak_is_the_schedules_max_in_flight(pp):
    cfg = preset_config("llama-tiny")
    for kind, v in KINDS[1:]:
        for m in range(1, 4 * pp + 2):
            if kind == "interleaved" and m % pp or pp * v > cfg.n_layer:
                continue
            est = activation_bytes(cfg, 1, 32, pp=pp, schedule=kind, microbatches=m, virtual_stages=v)
            assert est["peak_in_flight"] == _sim(pp, m, kind, v).peak_in_flight, (kind, pp, m)
            full = _in_flight_states(pp, m, kind, v)
            assert full == _in_flight_states(pp, m, kind, v)
            capped = _in_flight_states(pp, _cap(pp, m, kind, v), kind, v)
            assert capped[0] == full[0], (kind, pp, m)
            # the priced peak equals the uncapped walk's: the same maximal states per rank
            assert [max(s) for s in capped[1]] == [max(s) for s in full[1]], (kind, pp, m)


def test_zb_v_holds_one_f1b_peak_in_layers_and_zb_h1_prices_the_w_wait():
    cfg = preset_config("llama-tiny")  # 4 layers: pp 2 x 2 chunks of one layer
    for pp in (2, 3, 4, 6):
        for m in range(pp, 3 * pp + 1):
            peaks = _sim(pp, m, "zb-v", 2).peak_in_flight
            assert max(peaks) <= 2 * pp  # 2p chunks of half a rank's layers = 1F1B rank 0's p micro-batches
    one = activation_bytes(cfg, 1, 32, pp=2, schedule="1f1b", microbatches=4)
    zbh = activation_bytes(cfg, 1, 32, pp=2, schedule="zb-h1", microbatches=4)
    zbv = activation_bytes(cfg, 1, 32, pp=2, schedule="zb-v", microbatches=4, virtual_stages=2)
    assert one["peak_in_flight"] == [2, 1] and zbh["peak_in_flight"] == [2, 2] and zbv["peak_in_flight"] == [4, 4]
    assert one["wgrad_bytes"] == [0, 0] and min(zbh["wgrad_bytes"]) > 0
    # rank 0 of ZB-H1: 1F1B's 2 micro-batches held until W plus the W-pending captured gradients
    assert zbh["per_rank_bytes"][0] > one["per_rank_bytes"][0]
    assert zbh["per_rank_bytes"][1] > one["per_rank_bytes"][1]  # the last rank now holds 2, not 1


def _layouts(cfg, backend, **kw):
    cm = CostModel(hardware("h100"), gpus_per_node=4, backend=backend)
    return plan(cfg, 4, 10**13, 16, 256, cm, **kw)


def test_planner_prices_zero_bubble_and_keeps_zb_v_off_nccl():
    cfg = preset_config("gpt2")
    nccl, gloo = _layouts(cfg, "nccl"), _layouts(cfg, "gloo")
    kinds = {r["schedule"] for r in nccl["layouts"]}
    assert {"zb-h1", "1f1b", "interleaved", "gpipe"} <= kinds and "zb-v" not in kinds
    assert nccl["dropped"]["backend"] > 0 and gloo["dropped"]["backend"] == 0
    assert "zb-v" in {r["schedule"] for r in gloo["layouts"]}
    cm = CostModel(hardware("h100"), gpus_per_node=4)
    base = dict(dp=1, tp=1, pp=4, zero_stage=0, micro_batch=1, recompute="none")
    got = {k: evaluate(cfg, dict(base, schedule=k), 256, 16, cm) for k in ("1f1b", "zb-h1", "zb-v")}
    bub = {k: r["time_breakdown_s"]["bubble"] for k, r in got.items()}
    assert 0 < bub["zb-h1"] < bub["1f1b"] and 0 < bub["zb-v"] < bub["1f1b"]
    # zb-h1's fill/drain is (T_F + T_B - T_W)/(T_F + T_B + T_W) of 1F1B's at the layer's FLOP split
    h, S, W = cfg.n_embd, 256, 12 * cfg.n_embd ** 2
    f, b, w = 2 * W + 4 * h * S, 2 * W + 8 * h * S, 2 * W
    assert bub["zb-h1"] / bub["1f1b"] == pytest.approx((f + b - w) / (f + b + w))
    assert got["zb-v"]["virtual_stages"] == 2


def test_memory_cli_prices_zero_bubble_schedules(capsys):
    base = ["--model", "gpt2", "--dp", "1", "--seq", "256", "--pp", "4", "--microbatches", "8"]
    assert memory_main(base + ["--pp-schedule", "zb-v", "--json"]) == 0
    act = json.loads(capsys.readouterr().out)["activations"]
    assert act["schedule"] == "zb-v" and act["virtual_stages"] == 2 and act["gloo_only"]
    assert act["peak_in_flight"] == _sim(4, 8, "zb-v", 2).peak_in_flight
    assert act["bubble_fraction"] == pytest.approx(_sim(4, 8, "zb-v", 2).bubble_fraction)
    assert memory_main(base + ["--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "pipeline zb-h1: peak in flight per rank [4, 4, 4, 4]" in out and "bubble fraction 0.111" in out
    assert memory_main(base + ["--pp-schedule", "zb-v", "--virtual-stages", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "virtual_stages must be 2" in err and "\n" not in err
