"""The OpenAI-shaped request side of ``zerotron serve`` (rank 0, HTTP handler threads): a
validated body becomes a :class:`Job` (one row per prompt x choice) on the batcher's queue; the
answer (:meth:`Front.complete`) or the server-sent events (:meth:`Front.stream`) are built from
the rows' tokens. A client that goes away (``alive()`` turns false, or a write fails) cancels
its job: under continuous batching its rows leave the batch at the next iteration."""
from __future__ import annotations

import queue
import threading
import time

from .streaming import StreamText, cut_at_stop
from .validation import RequestError, parse_completion

__all__ = ["Job", "Front", "ServeStats", "ClientGone"]

POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready (its job is cancelled)."""


class ServeStats:
    """Counters shown by ``GET /health``: ``requests`` (HTTP requests answered), ``batches``
    (window batches decoded, or continuous iterations that admitted rows), ``steps`` (continuous
    iterations), ``running`` (rows in the continuous batch now), ``cancelled_rows`` (rows that
    left the batch because their client disconnected)."""

    def __init__(self):
        self.requests = self.batches = self.steps = self.running = self.cancelled_rows = 0


class Job:
    """One HTTP request's rows: ``requests`` (``zerotron.inference.Request``, one per prompt x
    choice); ``result[k]``: row k's new tokens once finished; ``events``: (row, token) as decoded,
    None at the end (streaming only); ``cancelled``: set when the client went away."""

    def __init__(self, requests, stream: bool = False):
        self.requests, self.done, self.error = requests, threading.Event(), None
        self.result: list = [None] * len(requests)
        self.pending = len(requests)
        self.events: queue.Queue | None = queue.Queue() if stream else None
        self.cancelled = threading.Event()

    def token(self, k: int, tok: int) -> None:
        if self.events is not None:
            self.events.put((k, tok))

    def finish(self, error: str | None = None) -> None:
        """Mark the job answered (``error``: the message of a 500 / an error event)."""
        self.error = error
        self.done.set()
        if self.events is not None:
            self.events.put(None)


class Front:
    """Rank 0's request side: validation, the job queue ``jobs`` the batcher reads, answers."""

    def __init__(self, tokenizer, eos_id, model_id: str, batching: str):
        self.tok, self.eos_id, self.model_id, self.batching = tokenizer, eos_id, model_id, batching
        self.jobs: queue.Queue = queue.Queue()
        self.draining = threading.Event()
        self.stats = ServeStats()
        self.counter = 0

    def health(self) -> dict:
        s = self.stats
        return {"status": "draining" if self.draining.is_set() else "ok", "batching": self.batching,
                "batches": s.batches, "requests": s.requests, "steps": s.steps, "running": s.running,
                "cancelled_rows": s.cancelled_rows}

    def _submit(self, body):
        """Validate ``body`` and enqueue its job; (parsed body, job). Raises RequestError."""
        from zerotron.inference import Request, SamplingParams

        if self.draining.is_set():
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        c = parse_completion(body, self.model_id)
        reqs = []
        for i, text in enumerate(c["prompts"]):
            ids = self.tok.encode(text).ids
            if not ids:
                raise RequestError(f"prompt {i} is empty after tokenization", param="prompt")
            for j in range(c["n"]):  # choice j of prompt i: seed + i * n + j (zerotron generate's for n = 1)
                reqs.append(Request(ids, SamplingParams(max_tokens=c["max_tokens"], temperature=float(c["temperature"]),
                                                        top_k=c["top_k"], top_p=float(c["top_p"]),
                                                        seed=c["seed"] + i * c["n"] + j, stop=tuple(c["stop"]))))
        job = Job(reqs, c["stream"])
        self.jobs.put(job)
        return c, job

    def _finish_reason(self, new: list[int], stops: list[str]) -> str:
        stopped = cut_at_stop(self.tok.decode(new), stops)[1]
        return "stop" if stopped or (bool(new) and new[-1] == self.eos_id) else "length"

    def _head(self) -> dict:
        self.counter += 1
        return {"id": f"cmpl-{self.counter}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_id}

    def complete(self, body, alive=None) -> dict:
        """Validate, enqueue, wait for the batcher; the OpenAI response dict. Raises RequestError,
        or ClientGone (after cancelling the job) when ``alive()`` turns false while waiting."""
        c, job = self._submit(body)
        while not job.done.wait(POLL_S):
            if alive is not None and not alive():
                job.cancelled.set()
                raise ClientGone()
        if job.error:
            raise RequestError(job.error, status=500, code="internal_error")
        choices, n_out = [], 0
        for k, new in enumerate(job.result):
            choices.append({"text": cut_at_stop(self.tok.decode(new), c["stop"])[0], "index": k, "logprobs": None,
                            "finish_reason": self._finish_reason(new, c["stop"])})
            n_out += len(new)
        n_in = sum(len(self.tok.encode(t).ids) for t in c["prompts"])
        return {**self._head(), "choices": choices,
                "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}

    def stream(self, body, alive=None):
        """Validate and enqueue a ``"stream": true`` body (RequestError now if it is bad); return
        (job, an iterator of the event dicts to send: one piece of text of one choice each, the
        last of a choice with its finish_reason). An engine failure ends it with an ``error``
        event; a client that is no longer ``alive()`` cancels the job and ends it."""
        c, job = self._submit(body)
        head, texts = self._head(), [StreamText(self.tok.decode, c["stop"]) for _ in job.requests]

        def chunk(k, text, reason=None):
            return {**head, "choices": [{"text": text, "index": k, "logprobs": None, "finish_reason": reason}]}

        def events():
            while True:
                try:
                    ev = job.events.get(timeout=POLL_S)
                except queue.Empty:
                    if alive is not None and not alive():
                        job.cancelled.set()
                        return
                    continue
                if ev is None:
                    break
                k, tok = ev
                piece = texts[k].push(tok)
                if piece:
                    yield chunk(k, piece)
            if job.error:
                yield {"error": {"message": job.error, "type": "server_error", "param": None, "code": "internal_error"}}
                return
            for k, new in enumerate(job.result):  # tokens not streamed (other dp replicas), then the rest
                for tok in new[len(texts[k].tokens):]:
                    texts[k].push(tok)
                yield chunk(k, texts[k].finish(), self._finish_reason(new, c["stop"]))
        return job, events()
