"""Every zerotron module imports on its own, first, in a fresh interpreter state.

One subprocess (torch is imported once): for each module found by pkgutil.walk_packages, every
``zerotron*`` entry is dropped from sys.modules and the module is imported fresh. An import cycle
that only works in one order (``partially initialized module``) fails here for the other order.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys, traceback
    import torch  # paid once; not a zerotron module
    import zerotron

    failures = []
    def walk_error(name):
        failures.append(name)
        print("=== " + name + " (walk_packages)\\n" + traceback.format_exc(), flush=True)
    names = sorted(m.name for m in pkgutil.walk_packages(zerotron.__path__, "zerotron.", onerror=walk_error))
    names = ["zerotron"] + [n for n in names if n.rsplit(".", 1)[-1] != "__main__"]
    for name in names:
        for key in [k for k in sys.modules if k == "zerotron" or k.startswith("zerotron.")]:
            del sys.modules[key]
        try:
            importlib.import_module(name)
        except BaseException:
            failures.append(name)
            print("=== " + name + "\\n" + traceback.format_exc(), flush=True)
    print("IMPORTED %d modules, %d failed: %s" % (len(names), len(failures), " ".join(failures)))
    sys.exit(1 if failures else 0)
    """
)


def test_every_module_imports_alone():
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": path})
    out = proc.stdout + proc.stderr
    assert "IMPORTED" in out, out
    assert proc.returncode == 0, out
    n = int(out.split("IMPORTED ", 1)[1].split()[0])
    assert n > 40, out  # the walk found the package, not an empty path


# What the launcher of ``zerotron train --nproc N`` and a plain data-parallel worker must not import
# (issue 27: every --nproc launch starts N + 1 fresh interpreters, so each import here is paid per
# process). The launcher parses, plans, checks the run directory and builds the token cache: it needs
# neither the engine (``zerotron.parallel``: FSDP2 -> DTensor -> sympy, ~0.75 CPU s) nor dynamo. A
# worker builds torch's AdamW, whose ``add_param_group`` is wrapped in ``torch._disable_dynamo`` and
# imports torch._dynamo (and with it DTensor and sympy) on its first call, so those stay allowed there.
_LAUNCHER_NEVER = ("zerotron.parallel", "zerotron.train.trainer", "torch.distributed.tensor", "torch.distributed.fsdp",
                   "torch.distributed.checkpoint", "sympy", "torch._dynamo", "matplotlib", "transformers", "fastapi",
                   "uvicorn")
_WORKER_NEVER = ("matplotlib", "transformers", "fastapi", "uvicorn", "zerotron.serve", "zerotron.inference",
                 "zerotron.analysis.dryrun")

_LAZY_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import zerotron.launch
    from zerotron.cli.main import main

    cache, run = sys.argv[1], sys.argv[2]
    found = {}
    def launch(nproc, argv, **kw):  # the launcher's state just before it would start its workers
        found["launcher"] = [m for m in LAUNCHER_NEVER if m in sys.modules]
        return 0
    zerotron.launch.launch = launch
    code = main(["train", "--config", "configs/tiny.toml", "--nproc", "2", "--run-dir", run + "/launch",
                 "--data.cache_dir", cache])
    assert code == 0 and "launcher" in found, (code, found)
    for k in ("ZEROTRON_LOCK_HELD", "ZEROTRON_RESUME_CMD"):
        os.environ.pop(k, None)

    from zerotron.plan import build_plan
    from zerotron.testing import tiny_config
    from zerotron.train.trainer import Trainer

    cfg = tiny_config({"data.cache_dir": cache, "log.plot": "true"})
    trainer = Trainer(cfg, run + "/worker", plan=build_plan(cfg, 1))
    assert type(trainer.strategy).__name__ == "DataParallel", type(trainer.strategy)
    found["worker"] = [m for m in WORKER_NEVER if m in sys.modules]
    print("FOUND", found)
    """
)


def test_launcher_and_ddp_worker_import_only_what_they_use(data_cache, tmp_path):
    """One fresh interpreter: the real ``zerotron train --nproc 2`` path up to the launch (torch
    elastic's start replaced by a probe), then a world-1 plain data-parallel Trainer. Neither may
    have imported the modules it does not use (:data:`_LAUNCHER_NEVER`, :data:`_WORKER_NEVER`)."""
    script = f"LAUNCHER_NEVER = {_LAUNCHER_NEVER!r}\nWORKER_NEVER = {_WORKER_NEVER!r}\n" + _LAZY_SCRIPT
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-c", script, data_cache, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FOUND" in out, out
    assert "FOUND {'launcher': [], 'worker': []}" in out, out
