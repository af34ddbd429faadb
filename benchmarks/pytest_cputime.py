"""pytest plugin: wall and CPU seconds of every test, the whole process tree counted.

``ZEROTRON_CPUTIME_OUT=times.jsonl python -m pytest -p pytest_cputime ...`` (with ``benchmarks/`` on
``PYTHONPATH``) appends one JSON line per test phase (setup, call, teardown) and one per collection:
``{"nodeid", "when", "wall_s", "cpu_s"}``. CPU seconds are user + system of the pytest process, of
its children already reaped, and of every live descendant (its own time plus that of the children it
reaped: ``/proc/<pid>/stat`` fields utime, stime, cutime, cstime), so pooled rank processes, the fork
server's CLI children and the workers of a ``--nproc`` launch all count, whoever reaps them. A
process re-parented away from the tree (an orphan adopted by init) is lost from the moment it leaves;
none of the suite's fixtures leaves one running. Linux only (reads /proc)."""
from __future__ import annotations

import json
import os
import resource
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int):
    """(ppid, cpu seconds incl. reaped children) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    # after the command name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / _TICK


def tree_cpu_s() -> float:
    """CPU seconds of this process, its reaped children, and every live descendant (see the module)."""
    me = os.getpid()
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    stats = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = _stat(int(name))
            if s is not None:
                stats[int(name)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo = list(children.get(me, []))
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


_OUT = os.environ.get("ZEROTRON_CPUTIME_OUT")


def _write(nodeid: str, when: str, wall: float, cpu: float) -> None:
    if _OUT:
        with open(_OUT, "a") as f:
            f.write(json.dumps({"nodeid": nodeid, "when": when, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
                    + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    t0, c0 = time.perf_counter(), tree_cpu_s()
    yield
    _write("<collection>", "collect", time.perf_counter() - t0, tree_cpu_s() - c0)


def _phase(item, when):
    t0, c0 = time.perf_counter(), tree_cpu_s()
    yield
    _write(item.nodeid, when, time.perf_counter() - t0, tree_cpu_s() - c0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _phase(item, "teardown")


def pytest_unconfigure(config):
    """The session's end: pooled ranks and the fork server exit after this; their last seconds are
    not counted (idle processes: ~0)."""
