"""The server subprocesses of ``zerotron bench serve`` (:mod:`zerotron.bench.serve_http`): start
``zerotron serve`` or ``transformers serve --continuous-batching`` (:func:`start_server`), wait for
``/v1/models``, read zerotron's ``/metrics`` (:func:`server_metrics`), stop them."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess: ``base`` (http://host:port), ``model`` (the id to send), ``lines``
    (its output so far); :meth:`stop` ends it (SIGTERM, then SIGKILL after 30 s)."""

    def __init__(self, name: str, cmd: list[str], env: dict, model: str, base: str | None = None):
        self.name, self.model, self.base = name, model, base
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: [self.lines.append(ln) for ln in self.proc.stdout], daemon=True).start()

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ready(base: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def start_server(kind: str, checkpoint: str, hf: str, threads: int, max_batch: int, extra: list[str],
                 timeout_s: float = 300) -> Server:
    """Start ``kind`` ("zerotron": ``zerotron serve`` on ``checkpoint``; "transformers":
    ``transformers serve --continuous-batching`` on the export ``hf``, CPU) with ``threads`` torch
    threads and wait until ``/v1/models`` answers. Raises RuntimeError (with the server's last
    output lines) if it exits or is not up within ``timeout_s``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    if kind == "zerotron":
        srv = Server(kind, [sys.executable, "-m", "zerotron", "serve", "--checkpoint", checkpoint, "--port", "0",
                            "--max-batch", str(max_batch), "--model-name", "bench", *extra], env, "bench")
    else:
        port = _free_port()
        code = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; main()"
        srv = Server(kind, [sys.executable, "-c", code, "serve", hf, "--continuous-batching", "--device", "cpu",
                            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra], env, hf,
                     f"http://127.0.0.1:{port}")
    deadline = time.time() + timeout_s
    while True:
        if srv.base is None and (m := re.search(r"listening on (http://\S+)", srv.output())):
            srv.base = m.group(1)
        if srv.base is not None and ready(srv.base):
            return srv
        if srv.proc.poll() is not None or time.time() > deadline:
            srv.stop()
            tail = "\n".join(srv.output().strip().splitlines()[-15:])
            raise RuntimeError(f"{kind} server did not start (exit {srv.proc.returncode}): {tail}")
        time.sleep(0.3)


def server_metrics(base: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("zerotron_") and "{" not in ln}
