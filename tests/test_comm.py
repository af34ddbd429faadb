"""comm.py: every collective sync and async, values, byte/call accounting, contiguity guard, and
a dead rank producing an error instead of a hang."""
import pytest
import torch

from zerotron.testing import run_ranks


def _collectives():
    import torch.distributed as dist

    from zerotron.distributed import comm
    from zerotron.distributed.mesh import Mesh, ParallelDims

    r, n = dist.get_rank(), dist.get_world_size()
    mesh = Mesh(ParallelDims(n), torch.device("cpu"))
    g = mesh.group("dp")
    comm.STATS.reset()
    out = {}
    for async_op in (False, True):
        x = torch.full((4,), float(r + 1))
        w = comm.all_reduce(x, group=g, async_op=async_op)
        if async_op:
            w.wait()
        out[f"all_reduce{async_op}"] = x.tolist()
        gathered = torch.empty(3 * n)
        w = comm.all_gather(gathered, torch.full((3,), float(r)), group=g, async_op=async_op)
        if async_op:
            w.wait()
        out[f"all_gather{async_op}"] = gathered.tolist()
        shard = torch.empty(2)
        w = comm.reduce_scatter(shard, torch.arange(2.0 * n) + r, group=g, async_op=async_op)
        if async_op:
            w.wait()
        out[f"reduce_scatter{async_op}"] = shard.tolist()
        b = torch.full((2,), float(r))
        w = comm.broadcast(b, src=0, group=g, async_op=async_op)
        if async_op:
            w.wait()
        out[f"broadcast{async_op}"] = b.tolist()
    recv = torch.empty(2)
    for w in comm.batch_isend_irecv([("send", torch.full((2,), float(r)), (r + 1) % n),
                                     ("recv", recv, (r - 1) % n)], group=g):
        w.wait()
    out["ring"] = recv.tolist()
    with pytest.raises(ValueError, match="not contiguous"):
        comm.all_reduce(torch.ones(4, 4).t()[0], group=g)
    with pytest.raises(ValueError, match="output must be 1-D"):
        comm.all_gather(torch.empty(n, 3), torch.ones(3), group=g)
    out["calls"] = comm.STATS.total_calls("all_reduce", "dp")
    out["ar_bytes"] = comm.STATS.total_bytes("all_reduce", "dp")
    out["ag_bytes"] = comm.STATS.total_bytes("all_gather", "dp")
    out["rs_bytes"] = comm.STATS.total_bytes("reduce_scatter", "dp")
    return out


def test_collectives_sync_async_and_accounting():
    n = 2
    res = run_ranks(_collectives, n)
    for r, out in enumerate(res):
        for a in (False, True):
            assert out[f"all_reduce{a}"] == [3.0] * 4
            assert out[f"all_gather{a}"] == [0.0] * 3 + [1.0] * 3
            # input rank q: arange(4)+q; sum over q in {0,1}: [1,3,5,7]; rank r gets [2r, 2r+2)
            assert out[f"reduce_scatter{a}"] == [[1.0, 3.0], [5.0, 7.0]][r]
            assert out[f"broadcast{a}"] == [0.0, 0.0]
        assert out["ring"] == [float((r - 1) % n)] * 2
        assert out["calls"] == 2                 # the refused call was not counted
        assert out["ar_bytes"] == 2 * 16          # 4 floats, twice
        assert out["ag_bytes"] == 2 * 4 * 3 * n   # output bytes, twice
        assert out["rs_bytes"] == 2 * 4 * 2 * n   # input bytes, twice


def _dies():
    import os

    import torch.distributed as dist

    from zerotron.distributed import comm

    if dist.get_rank() == 1:
        os._exit(3)
    comm.all_reduce(torch.ones(1))  # peer gone: must raise within the timeout, not hang
    return "unreachable"


def test_dead_rank_raises_not_hangs():
    """Rank 1's process ends; rank 0's all_reduce must raise the watchdog's CollectiveError naming
    the peer, not hang. Fresh ranks: the pool reports a rank whose process ended at once and ends
    the others, so any RuntimeError passed even if rank 0 hung; here rank 0's own error is awaited
    (a hang would end in the join timeout's message instead)."""
    with pytest.raises(RuntimeError, match=r"--- rank 0 ---\n(.|\n)*CollectiveError: all_reduce on group world "
                                           r"\(ranks \[0, 1\]\): rank 0 got no answer from peer\(s\) \[1\] \(dead or hung peer\?"):
        run_ranks(_dies, 2, timeout_s=10, join_timeout_s=120, fresh=True)


def test_in_flight_memory_is_guarded(single_process):
    """An async collective's tensors are registered until waited: touching them (another collective,
    or ``assert_idle`` before a plain read/write) raises at once instead of racing."""
    import pytest
    import torch

    from zerotron.distributed import comm
    from zerotron.distributed.inflight import in_flight

    buf = torch.ones(8)
    other = torch.ones(4)
    work = comm.all_reduce(buf, async_op=True, tag="grad")
    assert [w.op for w in in_flight()] == ["all_reduce"]
    with pytest.raises(RuntimeError, match="in-flight async all_reduce"):
        comm.assert_idle([buf[2:4]], "a gradient sum")
    with pytest.raises(RuntimeError, match="in-flight"):
        comm.all_reduce(buf[:4], tag="other")
    comm.assert_idle([other], "unrelated memory")  # no overlap: fine
    comm.all_reduce(other)
    work.wait()
    assert in_flight() == []
    comm.assert_idle([buf], "after wait")
    fut = comm.all_reduce(buf, async_op=True).get_future()  # torch owns completion (DDP comm hooks)
    assert in_flight() == []
    fut.wait()


def _group_timeouts():
    """(world, comm.new_group's, dist.new_group's) collective timeouts inside a run_ranks rank."""
    import torch.distributed as dist

    from zerotron.distributed import comm
    from zerotron.distributed.groups import world_timeout

    cpu = torch.device("cpu")
    return (world_timeout(), comm.new_group([0], backend="gloo")._get_backend(cpu).options._timeout,
            dist.new_group([0], backend="gloo")._get_backend(cpu).options._timeout)


def test_groups_made_outside_the_mesh_take_the_world_timeout():
    """torch gives a group made by dist.new_group its own 30-minute timeout, not the world's
    (parallel.timeout_s); comm.new_group passes the world's, and is the only way zerotron makes one
    (a background save's groups, a pipeline's tied pair, the expert groups waited 30 minutes on a
    hung peer). Checked in a rank whose world has a 7 s timeout (the pytest process's own world may
    have been made earlier in the session by another file with torch's default)."""
    import re
    from datetime import timedelta
    from pathlib import Path

    [(world, ours, torchs)] = run_ranks(_group_timeouts, 1, timeout_s=7)
    assert world == timedelta(seconds=7)
    assert ours == world
    assert torchs == timedelta(minutes=30)  # torch's
    root = Path(__file__).resolve().parent.parent / "zerotron"
    direct = [f"{p.relative_to(root)}:{i + 1}" for p in root.rglob("*.py") if p.name != "groups.py"
              for i, line in enumerate(p.read_text().splitlines()) if re.search(r"\bdist\.new_group\(", line)]
    assert direct == [], direct
