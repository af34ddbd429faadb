"""The threaded in-process pipeline (``parallel.pp_impl = "threads"``): stages on their own worker
threads in GPipe clock order, trains like one process (fp64), refusals. In the pytest process (world
size 1); the dp x threads layouts run in the parity matrix (schedule factor "threads")."""
import threading

import pytest
import torch

from zerotron import parity
from zerotron.config import ConfigError
from zerotron.plan import ParallelPlan, build_plan
from zerotron.testing import tiny_config

THREADS = {"parallel.pp_impl": "threads", "parallel.pp_schedule": "gpipe"}


def test_threaded_pipeline_parity_and_clock_order(data_cache, single_process, tmp_path, monkeypatch):
    from zerotron.parallel.pipeline.executor import StageModel

    extra = {"data.cache_dir": data_cache}
    ref = parity.reference(str(tmp_path / "ref"), extra)
    log, lock = [], threading.Lock()
    orig = StageModel.run_chunk

    def spy(self, chunk, x):
        with lock:
            log.append((self.stages[chunk], threading.current_thread().name, torch.is_grad_enabled()))
        return orig(self, chunk, x)

    monkeypatch.setattr(StageModel, "run_chunk", spy)
    # 4 stage threads, uneven auto split (3,2,2,1 on the matrix model), 4 micro-batches in 2 flushes of 2,
    # recomputed blocks; then 2 threads with the even split
    cases = [({"parallel.virtual_stages": 4, "parallel.microbatches": 2, "train.activation_checkpointing": "full"}, 4),
             ({"parallel.virtual_stages": 2, "parallel.pp_split": "even"}, 4)]
    for over, acc in cases:
        log.clear()
        lay = parity.Layout("ddp", 1, 1, False, 1, None, acc)
        out = parity.train_layout(lay, str(tmp_path / f"t{over['parallel.virtual_stages']}"), {**extra, **THREADS, **over})
        err = parity.compare(out, ref)
        assert max(err[k] for k in parity.ERRORS) <= parity.FP64_RTOL, (over, err)
        n = over["parallel.virtual_stages"]
        train = [(s, name) for s, name, grad in log if grad]  # forwards of training steps (eval runs densely)
        assert {name for _, name in train} == {f"zerotron-stage-{s}" for s in range(n)}
        assert all(name == f"zerotron-stage-{s}" for s, name in train), train[:8]
        # GPipe clock order within each flush: stage s starts micro-batch i only after stage s-1 ran it
        m = over.get("parallel.microbatches") or acc
        flush = [s for s, _ in train[:n * m]]
        pos = {}
        for k, s in enumerate(flush):
            pos.setdefault(s, []).append(k)
        assert all(len(v) == m for v in pos.values()), flush
        for s in range(1, n):
            assert all(a < b for a, b in zip(pos[s - 1], pos[s])), flush


def test_threaded_pipeline_timing_and_errors(single_process, monkeypatch):
    from zerotron.distributed.mesh import Mesh, ParallelDims
    from zerotron.models.gpt import GPT, GPTConfig
    from zerotron.parallel import parallelize
    from zerotron.parallel.pipeline.executor import StageModel
    from zerotron.parallel.pipeline.threads import ThreadedPipeline

    cfg = tiny_config({**THREADS, "parallel.virtual_stages": 2})
    mesh = Mesh(ParallelDims(1, 1, 1, 1), torch.device("cpu"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=4, n_head=2, n_embd=32))
    strat = parallelize(model, ParallelPlan.from_config(cfg, mesh.dims), mesh)
    assert isinstance(strat, ThreadedPipeline) and strat.split == [3, 1]  # head 2*32*4096 FLOPs: 3,1
    g = torch.Generator().manual_seed(0)
    mbs = [(torch.randint(0, 4096, (2, 16), generator=g), torch.randint(0, 4096, (2, 16), generator=g))
           for _ in range(3)]
    strat.zero_grad()
    loss = strat.forward_backward(mbs, 96, "fp32", torch.device("cpu"))
    model2 = GPT(GPTConfig(vocab_size=4096, block_size=16, n_layer=4, n_head=2, n_embd=32))
    model2.load_state_dict(model.state_dict())
    want = sum(torch.nn.functional.cross_entropy(model2(x).flatten(0, 1), y.flatten(), reduction="sum")
               for x, y in mbs)
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-6)
    tm = strat.last_step_timing()
    assert tm["schedule"] == (2, 3, "gpipe", 1) and sorted(tm["stage_compute_s"]) == ["B", "F"]
    assert all(sorted(v) == [0, 1] and min(v.values()) > 0 for v in tm["stage_compute_s"].values())
    assert 0 <= tm["bubble_fraction"] < 1 and all(w >= b for w, b in zip(tm["stage_walk_s"], tm["stage_busy_s"]))
    # an error on a stage thread reaches the caller; the workers stay usable
    orig = StageModel.run_chunk

    def boom(self, chunk, x):
        if self.stages[chunk] == 1:
            raise RuntimeError("stage 1 failed")
        return orig(self, chunk, x)

    monkeypatch.setattr(StageModel, "run_chunk", boom)
    with pytest.raises(RuntimeError, match="stage 1 failed"):
        strat.forward_backward(mbs, 96, "fp32", torch.device("cpu"))
    monkeypatch.setattr(StageModel, "run_chunk", orig)
    strat.zero_grad()
    assert float(strat.forward_backward(mbs, 96, "fp32", torch.device("cpu"))) == pytest.approx(float(loss), rel=1e-6)
    strat.close()


@pytest.mark.parametrize("over, world, msg", [
    ({"parallel.pp": 2, "parallel.virtual_stages": 2}, 2, "set parallel.pp = 1"),
    ({"parallel.pp_schedule": "1f1b", "parallel.virtual_stages": 2}, 1, "set parallel.pp_schedule = gpipe"),
    ({"parallel.virtual_stages": 1}, 1, "virtual_stages must be >= 2"),
    ({"parallel.virtual_stages": 2, "parallel.zero_stage": 1}, 2, "only with native DDP"),
    ({"parallel.virtual_stages": 2, "parallel.tp": 2}, 2, "only with native DDP"),
    ({"parallel.virtual_stages": 8}, 1, "at least one layer"),
])
def test_threaded_pipeline_refusals(over, world, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        build_plan(tiny_config({**THREADS, **over}), world)
    assert "\n" not in str(e.value)
