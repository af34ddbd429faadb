"""The HTTP front-end process of ``zerotron serve --frontend process`` (the default; the engine's
end and the messages: :mod:`~zerotron.serve.link`). It runs what the in-process server runs on
rank 0's HTTP thread -- uvicorn and the FastAPI app (:mod:`~zerotron.serve.http_api`), request
validation, tokenisation and chat templates, the streamed events (:class:`~zerotron.serve.api.Front`,
:class:`~zerotron.serve.api.Streamer`) -- with two more threads: one sends each job to the engine
(and a cancel when its client went away), the main one reads the engine's step messages into the
jobs and wakes their handlers, as the in-process batcher does.

Started by :func:`zerotron.serve.link.spawn_frontend` as ``python -m zerotron.serve.frontend FD``;
SIGINT and SIGTERM are ignored here (the engine process leads the drain and then says stop).
Exit code 0 after a stop, 1 if the engine's connection closed first (its open requests were
answered with a 500 error). It imports no torch (the request types are :mod:`zerotron.inference.request`;
:mod:`zerotron.inference` and :mod:`zerotron.data` import their torch parts on first use): its
start-up is uvicorn, FastAPI, pydantic and tokenizers, overlapped with the engine's model load."""
from __future__ import annotations

import queue
import signal
import socket
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from tokenizers import Tokenizer

from .api import Front, wake_jobs
from .chat import ChatTemplate
from .http_api import ServerThread, make_app

__all__ = ["serve_front", "main", "CANCEL_POLL_S"]

CANCEL_POLL_S = 0.05  # how often the job sender looks for jobs whose client went away
SHUTTING_DOWN = "the server is shutting down"
_DRAIN, _STOP = object(), object()  # markers on the front's job queue for the sender


class _Bridge:
    """The two ends of the engine connection ``conn`` inside the front end (see the module docstring)."""

    def __init__(self, front: Front, conn: Connection):
        self.front, self.conn = front, conn
        self.open: dict = {}  # job id -> Job, sent to the engine and not ended
        self.cancel_sent: set = set()
        self.sender = threading.Thread(target=self._send_jobs, daemon=True, name="zerotron-jobs")

    def _send_jobs(self) -> None:
        next_id, drained = 0, False
        while True:
            try:
                job = self.front.jobs.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                job = None
            try:
                if job is _STOP:
                    return
                if job is _DRAIN:
                    drained = True
                    self.conn.send(("drained",))
                elif job is not None and drained:  # submitted as the drain began: never sent
                    job.finish(SHUTTING_DOWN)
                elif job is not None:
                    self.open[next_id] = job
                    self.conn.send(("job", next_id, job.requests))
                    next_id += 1
                for jid, j in list(self.open.items()):
                    if j.cancelled.is_set() and jid not in self.cancel_sent:
                        self.cancel_sent.add(jid)
                        self.conn.send(("cancel", jid))
            except OSError:  # the engine is gone: the reader answers what is open
                return

    def run(self) -> int:
        """Read the engine's messages until it says stop (0) or its connection closes (1)."""
        self.sender.start()
        code = 1
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "step":
                _, toks, ended, stats = msg
                touched = []
                for jid, pairs in toks:
                    job = self.open.get(jid)
                    if job is not None:
                        for k, t in pairs:
                            job.token(k, t, wake=False)
                        touched.append(job)
                if stats is not None:
                    vars(self.front.stats).update(stats)
                for jid, result, error in ended:
                    job = self.open.pop(jid, None)
                    self.cancel_sent.discard(jid)
                    if job is not None:
                        job.result = result
                        job.finish(error)
                wake_jobs(touched)
            elif msg[0] == "drain":
                self.front.draining.set()
                self.front.jobs.put(_DRAIN)
            elif msg[0] == "stop":
                code = 0
                break
        self.front.draining.set()
        self.front.jobs.put(_STOP)
        self.sender.join()
        why = SHUTTING_DOWN if code == 0 else "the engine process stopped"
        for job in list(self.open.values()):
            job.finish(why)
        while True:
            try:
                job = self.front.jobs.get_nowait()
            except queue.Empty:
                break
            if job not in (_DRAIN, _STOP):
                job.finish(why)
        return code


def serve_front(conn: Connection) -> int:
    """Serve HTTP for the engine at the other end of ``conn``: read its ``("config", dict)`` (keys
    tokenizer (a ``tokenizers`` JSON string), eos (end ids or None), eos_token (its text),
    chat_template (a Jinja source or None: the default), model_id, batching, context (block_size),
    max_body_bytes, api_key, stats (the engine's ServeStats fields)) and the listening socket, answer ``("ready",)`` once uvicorn accepts
    connections, then relay jobs and tokens until the engine stops; the exit code (module docstring)."""
    try:
        msg = conn.recv()
        if msg[0] != "config":
            return 0  # the engine stopped before it served
        cfg = msg[1]
        sock = socket.socket(fileno=recv_handle(conn))
    except (EOFError, OSError):
        return 0
    front = Front(Tokenizer.from_str(cfg["tokenizer"]), cfg["eos"], cfg["model_id"], cfg["batching"],
                  chat=ChatTemplate(cfg["chat_template"], cfg["eos_token"]), context=cfg["context"],
                  vocab=cfg["vocab"])
    vars(front.stats).update(cfg["stats"])  # the pool's size before the first step (/metrics)
    server = ServerThread(make_app(front, cfg["max_body_bytes"], cfg["api_key"]), sock)
    server.start()
    conn.send(("ready",))
    code = _Bridge(front, conn).run()
    server.stop()  # idle keep-alive connections close now; answers being written finish first
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m zerotron.serve.frontend FD``: FD is this end of the engine's socket pair."""
    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return serve_front(Connection(int(argv[0])))


if __name__ == "__main__":
    sys.exit(main())
