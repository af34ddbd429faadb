"""The axes table (``zerotron.dims``), the one DeviceMesh built from it (``distributed.mesh.Mesh``) and
the plan's pipeline placement / backend rule. Pure arithmetic plus one 4-rank spawn for the groups."""
import itertools

import pytest

from zerotron.config import ConfigError
from zerotron.dims import AXES, COMBINED, ParallelDims
from zerotron.plan import ParallelPlan
from zerotron.stages import Placement
from zerotron.testing import run_ranks

SHAPES = [(8, 0, 2, 2, 1), (8, 0, 1, 2, 2), (8, 2, 2, 2, 2), (8, 0, 1, 1, 4), (12, 0, 2, 3, 1), (6, 0, 1, 3, 1),
          (16, 4, 2, 2, 2), (8, 0, 1, 1, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_coords_rank_and_groups_round_trip(shape):
    """Every rank's coordinates map back to it; with cp = 1 the numbering is the earlier (pp, dp, tp)
    one, (p*dp + d)*tp + t with d = r*S + s; each axis/combined group partitions the world, its members
    differ only on the group's axes, and peer() changes only the coordinates it is given."""
    d = ParallelDims(*shape)
    seen = set()
    for r in range(d.world_size):
        c = d.coords(r)
        assert d.rank(**{a: c[a] for a in AXES}) == r
        assert d.rank(pp=c["pp"], dp=c["dp"], cp=c["cp"], tp=c["tp"]) == r
        assert r == (c["pp"] * d.dp + c["dp"]) * d.tp + c["tp"]
        assert c["dp"] == c["dp_replicate"] * d.dp_shard + c["dp_shard"]
        seen.add(r)
        q = d.peer(r, pp=d.pp - 1)
        cq = d.coords(q)
        assert cq["pp"] == d.pp - 1 and all(cq[a] == c[a] for a in AXES if a != "pp")
        assert d.coords(d.peer(r, dp=0))["dp"] == 0 and d.coords(d.peer(r, dp=0))["tp"] == c["tp"]
    assert seen == set(range(d.world_size))
    for name in list(AXES) + list(COMBINED):
        groups = d.group_ranks(name)
        assert sorted(itertools.chain(*groups)) == list(range(d.world_size))
        axes = COMBINED.get(name, (name,))
        for g in groups:
            assert len(g) == d.size(name)
            others = [{a: d.coords(x)[a] for a in AXES if a not in axes} for x in g]
            assert all(o == others[0] for o in others)
            assert [d.coords(x)[name] for x in g] == list(range(len(g)))  # index in the group = coordinate
    assert d.size("batch") == d.dp * d.cp and d.size("shard") == d.dp_shard * d.cp
    assert d.size("loss") == d.pp * d.size("batch") and d.size("replicate") == d.dp_replicate


def test_dims_refusals():
    for kwargs, msg in [({"world_size": 6, "tp": 4}, "not divisible by tp\\*pp"),
                        ({"world_size": 8, "dp": 3}, "does not equal the world size"),
                        ({"world_size": 8, "dp_replicate": 3}, "must be >= 1 and divide the dp degree"),
                        ({"world_size": 8, "cp": 0}, "parallel.cp must be >= 1"),
                        ({"world_size": 0}, "world size must be >= 1"),
                        ({"world_size": 4, "tp": 1.5}, "must be an integer")]:
        with pytest.raises(ConfigError, match=msg):
            ParallelDims(**kwargs)
    d = ParallelDims(8, 0, 2, 2)
    for bad in ({"pp": 2, "dp": 0, "cp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "xx": 1}):
        with pytest.raises(ValueError):
            d.rank(**bad)
    with pytest.raises(ValueError, match="outside the world"):
        d.coords(8)
    for bad in ("bogus", "dp_rank"):
        with pytest.raises(KeyError, match="unknown group"):
            d.group_ranks(bad)
        with pytest.raises(KeyError, match="unknown group"):
            d.size(bad)


def test_placement_from_the_plan():
    """The plan builds the placement once: the loop (with interleaving) or zb-v's V."""
    loop = ParallelPlan(dims=ParallelDims(4, 1, 1, 4), pp_schedule="interleaved", virtual_stages=2, micro_batch=1,
                        global_batch=4).placement
    assert loop == Placement(4, 2, "loop") and loop.stages(1) == [1, 5] and loop.last_rank == 3
    v = ParallelPlan(dims=ParallelDims(4, 1, 1, 4), pp_schedule="zb-v", virtual_stages=2, backend="gloo").placement
    assert v == Placement(4, 2, "v") and v.stages(1) == [1, 6] and v.last_rank == 0
    assert [v.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert v.rank_costs([1, 2, 3, 4, 5, 6, 7, 8]) == [9, 9, 9, 9]
    assert ParallelPlan().placement == Placement(1)
    for bad in [(0, 1, "loop"), (2, 3, "v"), (2, 1, "zigzag")]:
        with pytest.raises(ValueError):
            Placement(*bad)


def test_zb_v_on_nccl_is_refused_by_the_plan():
    """Before any process group exists (the runner used to find out after building them)."""
    base = {"dims": ParallelDims(2, 1, 1, 2), "pp_schedule": "zb-v", "virtual_stages": 2}
    for extra in ({"backend": "nccl"}, {"device": "cuda"}):
        with pytest.raises(ConfigError, match="zb-v runs on the gloo backend only") as e:
            ParallelPlan(**base, **extra)
        assert "backend = gloo" not in str(e.value)  # no advice to run a GPU job's pipeline on gloo
    assert ParallelPlan(**base, backend="gloo").collective_backend == "gloo"
    assert ParallelPlan(**base, device="cpu").collective_backend == "gloo"
    assert ParallelPlan(**{**base, "pp_schedule": "zb-h1", "virtual_stages": 1}, backend="nccl")


def _groups_body(cases):
    import torch
    import torch.distributed as dist

    from zerotron.distributed.mesh import Mesh

    out = []
    for args in cases:
        d = ParallelDims(dist.get_world_size(), *args)
        m = Mesh(d, torch.device("cpu"))
        r, labels = dist.get_rank(), {}
        for name in list(AXES) + list(COMBINED):
            g = m.group(name)
            expect = next(grp for grp in d.group_ranks(name) if r in grp)
            assert sorted(dist.get_process_group_ranks(g.pg)) == expect, (args, name)
            assert m.local_rank(name) == expect.index(r) and m.size(name) == len(expect)
            t = torch.tensor([float(r)], dtype=torch.float64)
            dist.all_reduce(t, group=g.pg)
            assert t.item() == sum(expect), (args, name)
            labels[name] = g.name
        assert (m.group("dp_rep") is None) == (d.dp_replicate == 1)
        assert m.peer(pp=0) == d.peer(r, pp=0)
        out.append(labels)
    return out


def test_mesh_groups_on_four_ranks():
    """One DeviceMesh over the five axes; each axis and combined group has exactly the ranks the
    table says (checked by an all-reduce of the ranks); a group spanning the same ranks as an
    earlier one is that group, with one accounting label (shard is dp without HSDP)."""
    cases = [(0, 1, 1, 2), (0, 2, 2, 1), (0, 1, 2, 1), (0, 1, 1, 1)]
    labels = run_ranks(_groups_body, 4, cases)[0]
    hsdp, pp_tp, pp_dp, dp4 = labels
    assert hsdp["shard"] == "dp_shard" and hsdp["replicate"] == "dp_rep" and hsdp["dp"] == "dp"
    assert pp_tp["loss"] == "pp" and pp_tp["tp"] == "tp"  # (batch: a group of one rank)
    assert pp_dp["loss"] == "loss" and pp_dp["shard"] == "dp" and pp_dp["batch"] == "dp"
    assert dp4["shard"] == dp4["batch"] == dp4["dp_shard"] == "dp"
