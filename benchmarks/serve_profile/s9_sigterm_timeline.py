"""SIGTERM-to-exit timeline of ``zerotron serve --nproc 2 --parallel.pp 2 --batching window`` (the
server of tests/test_serve.py::test_serve_two_processes) with an idle keep-alive connection open:
when each process of the tree ended after the signal, and the server's lines after it.

Usage: ``PYTHONPATH=. python benchmarks/serve_profile/s9_sigterm_timeline.py RUN process|thread``
(``DUMP=S``: SIGUSR1 to the launcher S seconds after the SIGTERM, for a faulthandler registered by a
sitecustomize on PYTHONPATH)."""
import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time

from zerotron.testing_cli import process_tree

run, front = sys.argv[1], sys.argv[2]
env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRON_FORK_WORKERS": "1"}
p = subprocess.Popen([sys.executable, "-m", "zerotron", "serve", "--checkpoint", run, "--port", "0", "--nproc", "2",
                      "--parallel.pp", "2", "--microbatches", "2", "--batching", "window", "--batch-window-ms", "150",
                      "--frontend", front], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
lines = []
threading.Thread(target=lambda: [lines.append((time.monotonic(), ln.rstrip())) for ln in p.stdout], daemon=True).start()
while not any("listening on" in ln for _, ln in lines):
    assert p.poll() is None, lines
    time.sleep(0.1)
host, port = re.search(r"listening on http://([^:]+):(\d+)", "".join(ln for _, ln in lines)).groups()
idle = http.client.HTTPConnection(host, int(port), timeout=60)
idle.request("GET", "/health")
idle.getresponse().read()
tree = process_tree(p.pid)
time.sleep(1)
t0 = time.monotonic()
if os.environ.get("DUMP"):
    threading.Timer(float(os.environ["DUMP"]), lambda: os.kill(p.pid, signal.SIGUSR1)).start()
p.send_signal(signal.SIGTERM)
ends: dict = {}


def gone(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


while p.poll() is None or any(pid not in ends for pid in tree):
    for pid in tree:
        if pid not in ends and gone(pid):
            ends[pid] = time.monotonic() - t0
    time.sleep(0.02)
print(front, "exit code", p.returncode, f"after {time.monotonic() - t0:.2f} s; load", open("/proc/loadavg").read().split()[:3])
for pid in tree:
    print(f"  pid {pid} ended at {ends.get(pid, -1):.2f} s")
for t, ln in lines:
    if t >= t0:
        print(f"  {t - t0:.2f} s: {ln}")
