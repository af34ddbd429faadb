"""Pipeline executor overhead accounting, without process groups: comm runs of a schedule, the
receive-wait split (dependency vs transfer), the replay of measured per-action times through the
simulator, the simulator's ``durations`` override, the zb-h1 prediction with background sends, and
the bench's idle-split summary. The executor's p2p modes themselves are parity-checked in
tests/test_pipeline.py (2 processes)."""
import pytest

from zerotron.bench.bubble import idle_split
from zerotron.parallel.pipeline.accounting import predicted_bubble, recv_wait_split, replayed_bubble
from zerotron.parallel.pipeline.p2p import comm_runs
from zerotron.parallel.pipeline.schedules import COMM, build_schedule, message_key
from zerotron.parallel.pipeline.simulation import rank_idle_fractions, simulate


def test_comm_runs_cover_every_comm_action_once():
    for kind, v in (("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("gpipe", 1)):
        for acts in build_schedule(2, 4, kind, v):
            runs = comm_runs(acts)
            covered = [k for i, j in runs for k in range(i, j)]
            assert covered == [k for k, a in enumerate(acts) if a.kind in COMM], kind
            for (i, j), nxt in zip(runs, runs[1:]):  # maximal: a compute between two runs
                assert j < nxt[0] and acts[j].kind not in COMM
    assert comm_runs([]) == []


def _events(sim, pp, t0=0.0, latency=0.0):
    """Executor-like events of a simulated walk: computes as simulated, each send posted at the end
    of its producer, each receive waited from the end of the rank's previous compute to the
    sender's post + ``latency`` (no earlier than its start)."""
    sched = sim["schedule"]
    evs = [[] for _ in range(pp)]
    ends = {}
    for r, iv in enumerate(sim["res"].intervals):
        for s, e, a in iv:
            st = a.chunk * pp + r
            evs[r].append(("C", 1, (a.kind, a.microbatch, st), t0 + s, t0 + e))
            ends[(a.kind, a.microbatch, st)] = t0 + e
    for r, acts in enumerate(sched):
        prev = t0
        for a in acts:
            if a.kind in ("F", "B", "W"):
                prev = ends[(a.kind, a.microbatch, a.chunk * pp + r)]
                continue
            key = message_key(a, r, sched.placement)
            producer = ends[("F" if key[0] == "F" else "B", key[1], key[2])]
            if a.kind.startswith("SEND"):
                evs[r].append(("S", 1, key, producer))
            else:
                evs[r].append(("R", 1, key, prev, max(prev, producer + latency)))
    return evs


def test_recv_wait_split_dependency_and_transfer():
    # rank 1 waits 0..5 for a send posted at 3: 3 s dependency, 2 s transfer; a prefetched receive
    # whose send was posted before the wait began is all transfer
    evs = [[("S", 1, ("F", 0, 0), 3.0), ("S", 1, ("F", 1, 0), 6.0)],
           [("R", 1, ("F", 0, 0), 0.0, 5.0), ("R", 1, ("F", 1, 0), 7.0, 7.5),
            ("R", 2, ("F", 0, 0), 1.0, 2.0)]]  # walk 2: its send is not in the trace -> transfer
    got = recv_wait_split(evs)
    assert got[0] == {"dependency_s": 0.0, "transfer_s": 0.0, "recvs": 0, "latencies_s": []}
    assert got[1]["recvs"] == 3
    assert got[1]["latencies_s"] == pytest.approx([2.0])  # only the receive waiting when its send was posted
    assert got[1]["dependency_s"] == pytest.approx(3.0) and got[1]["transfer_s"] == pytest.approx(2.0 + 0.5 + 1.0)
    # keys arrive as lists after a JSON / all_gather_object round trip
    lists = [[tuple(list(x) if isinstance(x, tuple) else x for x in e) for e in ev] for ev in evs]
    assert recv_wait_split(lists) == got


def test_simulate_durations_override_one_action():
    sched = build_schedule(2, 4, "1f1b")
    base = simulate(sched, 2, 1, 1.0, 2.0, eager_sends=True)
    slow = simulate(sched, 2, 1, 1.0, 2.0, eager_sends=True, durations={("B", 0, 1): 5.0})
    assert slow.makespan == pytest.approx(base.makespan + 3.0)  # B0 of the last stage is on the critical path
    b0 = [(s, e) for s, e, a in slow.intervals[1] if (a.kind, a.microbatch) == ("B", 0)][0]
    assert b0[1] - b0[0] == pytest.approx(5.0)
    full = {(a.kind, a.microbatch, r): 1.0 if a.kind == "F" else 2.0 for r, acts in enumerate(sched)
            for a in acts if a.kind in ("F", "B")}
    assert simulate(sched, 2, 1, 9.0, 9.0, eager_sends=True, durations=full).intervals == base.intervals


def test_simulate_latency_delays_each_message():
    """GPipe, uniform stages, latency L per message: the fill and the drain each cross p-1 links,
    so the makespan is (m+p-1)(f+b) + 2(p-1)L (L <= f, b: the steady stream hides the rest)."""
    for p, m in ((2, 4), (3, 6), (4, 8)):
        sched = build_schedule(p, m, "gpipe")
        for lat in (0.0, 0.1, 0.5):
            got = simulate(sched, p, 1, 1.0, 2.0, eager_sends=True, latency=lat)
            assert got.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * lat), (p, m, lat)
    # 1F1B at p = 2 with equal stages: unlike GPipe, steady-state messages are on the critical path
    # too (F(i+1) waits for the B(i) gradient's round trip), at most all 2m of them
    sched = build_schedule(2, 8, "1f1b")
    free = simulate(sched, 2, 1, 1.0, 2.0, eager_sends=True)
    slow = simulate(sched, 2, 1, 1.0, 2.0, eager_sends=True, latency=0.1)
    assert free.makespan + 2 * 0.1 + 1e-9 < slow.makespan <= free.makespan + 2 * 8 * 0.1 + 1e-9
    assert simulate(build_schedule(1, 4, "gpipe"), 1, 1, latency=7.0).makespan == pytest.approx(12.0)  # no messages
    with pytest.raises(ValueError, match="latency"):
        simulate(sched, 2, 1, latency=-1.0)
    # predicted_bubble passes it on; more latency never predicts less idle
    st = {"F": {0: 1.0, 1: 1.0}, "B": {0: 2.0, 1: 2.0}}
    fr = [predicted_bubble(2, 8, "1f1b", 1, st, latency_s=x)["max"] for x in (0.0, 0.05, 0.1)]
    assert fr[0] < fr[1] < fr[2]
    assert predicted_bubble(2, 8, "1f1b", 1, st, latency_s=0.1)["makespan_s"] == pytest.approx(slow.makespan)


def test_replayed_bubble_equals_the_walk_it_replays():
    for kind, costs in (("1f1b", dict(f_cost=[1.0, 1.5], b_cost=[2.0, 3.0])),
                        ("zb-h1", dict(f_cost=[1.0, 1.0], b_cost=[0.5, 1.0], w_cost=[1.0, 0.7]))):
        sched = build_schedule(2, 8, kind)
        res = simulate(sched, 2, 1, eager_sends=True, **costs)
        evs = _events({"schedule": sched, "res": res}, 2, t0=100.0)
        rep = replayed_bubble(2, 8, kind, 1, evs)
        assert rep["per_rank"] == pytest.approx(rank_idle_fractions(res)), kind
        # measured-like waits with pure dependency (latency 0) are all "wait for sender"
        split = recv_wait_split(evs)
        assert all(s["transfer_s"] == pytest.approx(0.0, abs=1e-12) for s in split)
    # jitter: one slow forward of stage 0 -> the replay sees the extra wait of stage 1, while the
    # per-stage means spread it over every micro-batch
    sched = build_schedule(2, 8, "1f1b")
    res = simulate(sched, 2, 1, 1.0, 2.0, eager_sends=True, durations={("F", 3, 0): 6.0})
    evs = _events({"schedule": sched, "res": res}, 2)
    assert replayed_bubble(2, 8, "1f1b", 1, evs)["max"] == pytest.approx(max(rank_idle_fractions(res)))
    means = {"F": {0: (7 * 1.0 + 6.0) / 8, 1: 1.0}, "B": {0: 2.0, 1: 2.0}}
    assert predicted_bubble(2, 8, "1f1b", 1, means)["max"] < max(rank_idle_fractions(res))
    with pytest.raises(ValueError, match="no compute events of rank 1"):
        replayed_bubble(2, 8, "1f1b", 1, [evs[0], [e for e in evs[1] if e[0] != "C"]])


def test_predicted_bubble_uses_background_sends_like_the_executor():
    """zb-h1: a rank runs W while the B gradient it sent waits for the upstream rank; with
    rendezvous sends the prediction would be pessimistic (makespan 167.7 vs 140.7 here)."""
    st = {"F": {0: 6.5, 1: 5.6}, "B": {0: 0.03, 1: 5.5}, "W": {0: 10.4, 1: 4.5}}
    got = predicted_bubble(2, 8, "zb-h1", 1, st)
    costs = dict(f_cost=[6.5, 5.6], b_cost=[0.03, 5.5], w_cost=[10.4, 4.5])
    eager = simulate(build_schedule(2, 8, "zb-h1"), 2, 1, eager_sends=True, **costs)
    strict = simulate(build_schedule(2, 8, "zb-h1"), 2, 1, **costs)
    assert got["makespan_s"] == pytest.approx(eager.makespan) and eager.makespan < strict.makespan - 20
    one = predicted_bubble(2, 8, "1f1b", 1, {"F": st["F"], "B": {0: 10.43, 1: 10.0}})
    assert got["makespan_s"] < one["makespan_s"]  # zb-h1 beats 1f1b on these costs


def test_bench_idle_split_summary():
    sched = build_schedule(2, 4, "1f1b")
    res = simulate(sched, 2, 1, 1.0, 2.0, eager_sends=True)
    evs = _events({"schedule": sched, "res": res}, 2, t0=50.0, latency=0.25)
    walk_end = [50.0 + iv[-1][1] for iv in res.intervals]
    got = []
    for r in range(2):
        busy = sum(e - s for s, e, _ in res.intervals[r])
        rw = sum(e[4] - e[3] for e in evs[r] if e[0] == "R")
        step = {"busy_s": busy, "idle_s": rw + 0.1, "post_s": 0.1, "post_cpu_s": 0.05, "recv_wait_s": rw, "send_wait_s": 0.0,
                "other_s": 0.01, "walk_start_s": 50.0 + 0.5 * r, "p2p_events": evs[r]}
        assert walk_end[r] > 50.0
        got.append({"p2p": [step, step], "host": "h", "pipe": [r, 0, 0], "schedule": (2, 4, "1f1b", 1),
                    "stage_times": [{"F": {r: 1.0}, "B": {r: 2.0}}] * 2})
    out = idle_split(got, 2)
    split = recv_wait_split(evs)
    walks = [s["busy_s"] + s["idle_s"] for s in (g["p2p"][0] for g in got)]
    top = max(range(2), key=lambda r: got[r]["p2p"][0]["idle_s"] / walks[r])
    assert out["idle_dependency"] == pytest.approx(split[top]["dependency_s"] / walks[top])
    assert out["idle_transfer"] == pytest.approx(split[top]["transfer_s"] / walks[top]) and out["idle_transfer"] > 0
    assert out["idle_dependency"] + out["idle_transfer"] + out["idle_post"] == pytest.approx(
        got[top]["p2p"][0]["idle_s"] / walks[top])
    assert out["idle_post_cpu"] == pytest.approx(out["idle_post"] / 2)
    assert out["start_skew_ms"] == pytest.approx(500.0) and out["other_fraction"] == pytest.approx(0.01 / walks[top])
    assert out["bubble_replayed"] == pytest.approx(max(rank_idle_fractions(res)))
    assert out["p2p_latency_ms"] == pytest.approx(250.0)  # every waiting receive: 0.25 s after its send
    # the simulation and the replay again, each message taking the measured latency
    st = {"F": {0: 1.0, 1: 1.0}, "B": {0: 2.0, 1: 2.0}}
    want = predicted_bubble(2, 4, "1f1b", 1, st, latency_s=0.25)["max"]
    assert out["bubble_sim_latency"] == pytest.approx(want) and want > predicted_bubble(2, 4, "1f1b", 1, st)["max"]
    assert out["bubble_replay_latency"] == pytest.approx(replayed_bubble(2, 4, "1f1b", 1, evs, latency_s=0.25)["max"])
    assert out["bubble_replay_latency"] > out["bubble_replayed"]
    assert out["latency_ratio"] == pytest.approx(got[top]["p2p"][0]["idle_s"] / walks[top] / want)
    assert len(out["idle_split_steps"]) == 2 and len(out["bubble_replayed_steps"]) == 2
    assert idle_split([{**g, "host": f"h{i}"} for i, g in enumerate(got)], 2) == {}  # two hosts: no clocks
    assert idle_split([{**g, "p2p": []} for g in got], 2) == {}  # not the native executor
