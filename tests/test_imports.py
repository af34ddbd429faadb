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
