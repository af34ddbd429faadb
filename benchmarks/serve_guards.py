"""What Dynamo's guards cost the compiled paged decode (issue 31, eighth session): thread CPU per
engine step with the guards evaluated on every call against ``torch.compiler.set_stance(
skip_guard_eval_unsafe=True)`` (only the guards that tell cached graphs apart), paired per round in
alternating order, tokens checked equal; 16 then 64 random rows (``serve_engine_profile.py``'s
workload), one torch thread.

Usage: ``PYTHONPATH=. python benchmarks/serve_guards.py CHECKPOINT [ROUNDS]``.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_engine_profile as sep  # noqa: E402

from zerotron.distributed.mesh import Mesh, ParallelDims, init_distributed  # noqa: E402
from zerotron.generate import load_model, resolve_checkpoint  # noqa: E402
from zerotron.inference import Engine, Request, SamplingParams  # noqa: E402
from zerotron.inference import paged_compiled as pc  # noqa: E402

torch.set_num_threads(1)
init_distributed("gloo", 300, torch.device("cpu"))
model, tok, _ = load_model(resolve_checkpoint(sys.argv[1]), torch.device("cpu"))
eng = Engine(model.eval(), Mesh(ParallelDims(1), torch.device("cpu")))
V = model.config.vocab_size
params = SamplingParams(max_tokens=128, stop_at_eos=False)
t0 = time.perf_counter()
sep.run(eng, [Request(p, params) for p in sep.prompts("random", 4, V, 99)], compile=True)
print(f"warm-up {time.perf_counter()-t0:.1f} s", flush=True)
orig = pc.CompiledPagedDecode.__call__
def skipping(self, *args):
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        return orig(self, *args)
for B in (16, 64):
    reqs = [Request(p, params) for p in sep.prompts("random", B, V, B)]
    for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
        got = {}
        for mode in (["eval", "skip"] if r % 2 == 0 else ["skip", "eval"]):
            pc.CompiledPagedDecode.__call__ = skipping if mode == "skip" else orig
            rec = sep.run(eng, reqs, compile=True)
            got[mode] = (rec["cpu_ms_per_step"], rec.pop("out"))
            print(f"B={B} round {r} {mode}: {rec['cpu_ms_per_step']:.3f} ms CPU/step, wall {rec['wall_ms_per_step']:.2f}", flush=True)
        assert got["eval"][1] == got["skip"][1]
        print(f"  paired skip/eval {got['skip'][0]/got['eval'][0]:.3f}", flush=True)
