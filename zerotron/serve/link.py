"""The engine's end of ``zerotron serve --frontend process`` (the default): the HTTP front end runs
in a process of its own (:mod:`~zerotron.serve.frontend`), so the engine's loop never waits for
the GIL while HTTP requests are parsed, prompts tokenised and streamed events encoded -- the
layout of vLLM V1 (an API server process and an EngineCore process joined by a socket).

Rank 0 starts the front end first (:func:`spawn_frontend`: it imports its modules while the
engine loads the model), then :meth:`FrontendLink.start` sends it the settings and the listening
socket and waits until it serves. The batchers (:mod:`~zerotron.serve.batching`) read
:class:`RemoteFront` exactly as they read the in-process :class:`~zerotron.serve.api.Front`:
``jobs`` (a queue fed by the front end's connection, polled without blocking at every step),
``draining``, ``stats`` and :meth:`RemoteFront.publish`, which sends one message per engine step
with every token decoded in it, the jobs that ended, and the counters when they changed.

Messages (pickled tuples over one ``AF_UNIX`` stream socket, ``multiprocessing.connection``):

* engine -> front end: ``("config", dict)`` (then the listening socket as a passed descriptor),
  ``("step", [(job id, [(row, token), ...]), ...], [(job id, result, error), ...], stats or None)``,
  ``("drain",)`` (SIGTERM: refuse new requests), ``("stop",)`` (the engine stopped: close and exit);
* front end -> engine: ``("ready",)``, ``("job", job id, [Request, ...])``, ``("cancel", job id)``
  (its client went away), ``("drained",)`` (no job comes after this one).

If the front end dies, the engine cancels every job and stops (:attr:`RemoteFront.lost`); if the
engine dies, the front end sees the connection close, answers what is open with an error and
exits: neither outlives the other."""
from __future__ import annotations

import collections
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle

from .api import ServeStats

__all__ = ["spawn_frontend", "FrontendLink", "RemoteFront", "RemoteJob", "POLL_S"]

POLL_S = 0.1  # a waiting batcher looks at the connection (and a SIGTERM) at least this often


def spawn_frontend() -> FrontendLink:
    """Start the front-end process (``python -m zerotron.serve.frontend FD``, one end of a socket
    pair passed as FD); it waits for :meth:`FrontendLink.start`. It runs in a session of its own,
    so a terminal's Ctrl-C (SIGINT to the foreground process group) reaches the engine, which leads
    the stop, and not the front end while it is still importing its modules (a KeyboardInterrupt
    traceback there); it exits when the engine's connection closes, however the engine ended."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "zerotron.serve.frontend", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        theirs.close()
    return FrontendLink(proc, Connection(mine.detach()))


class FrontendLink:
    """The running front-end process ``proc`` and the engine's end ``conn`` of its connection."""

    def __init__(self, proc: subprocess.Popen, conn: Connection):
        self.proc, self.conn = proc, conn
        self.configured = False  # start() sent the settings: from then on close() asks it to stop

    def start(self, config: dict, sock: socket.socket, timeout_s: float = 300.0) -> None:
        """Send the front end its settings (:func:`zerotron.serve.frontend.serve_front`'s
        ``config``) and the listening socket ``sock``, and wait until it accepts connections.
        Raises RuntimeError if it exits or does not answer within ``timeout_s``."""
        self.configured = True
        try:
            self.conn.send(("config", config))
            send_handle(self.conn, sock.fileno(), self.proc.pid)
            if not self.conn.poll(timeout_s):
                raise RuntimeError(f"the HTTP front-end process did not start within {timeout_s:g} s")
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the HTTP front-end process exited (code {self.proc.wait()}) before serving; "
                               "its error is above") from None
        if msg != ("ready",):
            raise RuntimeError(f"the HTTP front-end process answered {msg!r} instead of ready")

    def close(self, timeout_s: float = 60.0) -> int | None:
        """Tell the front end to stop (it closes idle connections, finishes the answers being
        written) and wait for it (SIGKILL after ``timeout_s``); its exit code. A front end that
        was never configured (the engine stopped while starting) serves nothing and may still be
        importing its modules (seconds on a loaded machine): it is killed at once."""
        if not self.configured:
            self.proc.kill()
        try:
            self.conn.send(("stop",))
        except OSError:  # it is gone already
            pass
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.conn.close()
        return code


class RemoteJob:
    """The engine's view of one front-end job (the batchers use the attributes and methods of
    :class:`~zerotron.serve.api.Job` that they need): ``requests``, ``result``, ``pending``,
    ``cancelled``; :meth:`token` and :meth:`finish` queue what the next :meth:`RemoteFront.publish`
    sends."""

    def __init__(self, front: RemoteFront, jid: int, requests: list):
        self.front, self.jid, self.requests = front, jid, requests
        self.result: list = [None] * len(requests)
        self.pending = len(requests)
        self.cancelled = threading.Event()
        self.tokens: list = []  # (row, token) since the last publish

    def token(self, k: int, tok: int, wake: bool = True) -> None:
        if not self.tokens:
            self.front.touched.append(self)
        self.tokens.append((k, tok))
        if wake:
            self.front.publish(())

    def finish(self, error: str | None = None) -> None:
        self.front.ended.append((self.jid, self.result, error))
        self.front.open.pop(self.jid, None)


class _Inbox:
    """``RemoteFront.jobs``: the jobs the front end sent, in order (``queue.Queue``'s get,
    get_nowait, empty); every call first reads what the connection holds (jobs, cancels, drained)."""

    def __init__(self, front: RemoteFront):
        self.front, self.arrived = front, collections.deque()

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        self.front.pump(0.0)
        while not self.arrived:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self.front.lost or self.front.draining.is_set():
                raise queue.Empty  # draining: the front end sends no more jobs, the batcher may stop now
            self.front.pump(POLL_S if left is None else min(left, POLL_S))  # a SIGTERM is seen within POLL_S
        return self.arrived.popleft()

    def get_nowait(self):
        self.front.pump(0.0)
        if not self.arrived:
            raise queue.Empty
        return self.arrived.popleft()

    def empty(self) -> bool:
        self.front.pump(0.0)
        return not self.arrived


class RemoteFront:
    """What the batchers read on rank 0 when the HTTP front end is another process (see the
    module docstring): ``jobs``, ``draining``, ``stats`` (:class:`~zerotron.serve.api.ServeStats`,
    sent to the front end for ``/health`` and ``/metrics``), :meth:`publish`. ``stop``: set on
    SIGTERM; the front end is then told to drain, and ``draining`` is set once it has sent its
    last job. ``lost``: the front end's connection closed (every open job is cancelled)."""

    def __init__(self, link: FrontendLink, stop: threading.Event):
        self.link, self.conn, self.stop = link, link.conn, stop
        self.jobs = _Inbox(self)
        self.draining = threading.Event()
        self.stats = ServeStats()
        self.open: dict[int, RemoteJob] = {}
        self.touched: list[RemoteJob] = []
        self.ended: list = []
        self.lost = False
        self._drain_sent = False
        self._sent_stats: dict = {}
        self._lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        if self.lost:
            return
        try:
            with self._lock:
                self.conn.send(msg)
        except OSError:
            self._lose()

    def _lose(self) -> None:
        self.lost = True
        self.draining.set()
        for j in self.open.values():
            j.cancelled.set()

    def pump(self, timeout: float | None) -> None:
        """Handle the messages that arrived (waiting up to ``timeout`` seconds for the first);
        first send the jobs that ended outside a step (cancelled while waiting), if any."""
        if self.ended:
            self.publish(())
        if self.stop.is_set() and not self._drain_sent:
            self._drain_sent = True
            self.send(("drain",))
        if self.lost:
            return
        try:
            ready = self.conn.poll(timeout)
            while ready:
                msg = self.conn.recv()
                if msg[0] == "job":
                    job = self.open[msg[1]] = RemoteJob(self, msg[1], msg[2])
                    self.jobs.arrived.append(job)
                elif msg[0] == "cancel":
                    if (job := self.open.get(msg[1])) is not None:
                        job.cancelled.set()
                elif msg[0] == "drained":
                    self.draining.set()
                ready = self.conn.poll(0)
        except (EOFError, OSError):
            self._lose()

    def publish(self, jobs) -> None:
        """Send the tokens decoded and the jobs ended since the last call, and the counters if
        they changed (the batchers call it once per step; ``jobs`` is unused: every job that got
        a token is sent)."""
        stats = vars(self.stats)
        changed = stats != self._sent_stats
        if not (self.touched or self.ended or changed):
            return
        toks = [(j.jid, j.tokens) for j in self.touched]
        for j in self.touched:
            j.tokens = []
        self.touched = []
        ended, self.ended = self.ended, []
        if changed:
            self._sent_stats = dict(stats)
        self.send(("step", toks, ended, self._sent_stats if changed else None))

