"""The OpenAI-shaped request side of ``zerotron serve`` (rank 0, the HTTP server's thread): a
validated body becomes a :class:`Job` (one row per prompt x choice) on the batcher's queue
(:meth:`Front.submit`); the answer (:meth:`Front.answer`) or the stream's events
(:class:`Streamer`) are built from the rows' tokens with the pydantic models of
:mod:`~zerotron.serve.schemas`. The HTTP layer (:mod:`~zerotron.serve.http_api`) waits for the
job and cancels it (``job.cancelled``) when the client goes away: under continuous batching its
rows leave the batch at the next iteration."""
from __future__ import annotations

import queue
import threading
import time

from ..inference.batch import is_eos
from .schemas import (
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    ChatDelta,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
    validate,
)
from .streaming import StreamText, cut_at_stop
from .validation import RequestError, check_model, sampling

__all__ = ["Job", "Front", "ServeStats", "Streamer", "CHAT_MAX_TOKENS"]

CHAT_MAX_TOKENS = 256  # a chat request's max_tokens when it gives none (OpenAI: up to the context)


class ServeStats:
    """Counters shown by ``GET /health``: ``requests`` (requests answered by the batcher),
    ``batches`` (window batches decoded, or continuous iterations that admitted rows), ``steps``
    (continuous iterations), ``running`` (rows in the continuous batch now), ``cancelled_rows``
    (rows that left the batch because their client disconnected); paged KV cache (continuous
    batching): ``kv_blocks_used``/``kv_blocks_free`` (all dp replicas), ``prefix_hits``/
    ``prefix_misses`` (full prompt blocks found / not found cached), ``preemptions``,
    ``kv_slots_allocated``/``kv_slots_filled`` (slots of the blocks in use / of those, slots
    holding a cached token: the KV waste is 1 - filled / allocated); speculative
    decoding: ``spec_proposed``/``spec_accepted`` (draft tokens)."""

    def __init__(self):
        self.requests = self.batches = self.steps = self.running = self.cancelled_rows = 0
        self.kv_blocks_used = self.kv_blocks_free = self.prefix_hits = self.prefix_misses = self.preemptions = 0
        self.spec_proposed = self.spec_accepted = 0
        self.kv_slots_allocated = self.kv_slots_filled = 0


class Job:
    """One HTTP request's rows: ``requests`` (``zerotron.inference.Request``, one per prompt x
    choice); ``result[k]``: row k's new tokens once finished; ``events``: (row, token) as decoded,
    None at the end (streaming only); ``cancelled``: set when the client went away. Timings per
    row (``time.monotonic`` seconds): ``t0`` (submitted), ``first[k]``/``last[k]`` (its first and
    latest token, None before), ``ntok[k]``. ``wake``: called (from the batcher's thread) after
    each token and at the end, so a waiter need not poll."""

    def __init__(self, requests, stream: bool = False):
        self.requests, self.done, self.error = requests, threading.Event(), None
        self.result: list = [None] * len(requests)
        self.pending = len(requests)
        self.events: queue.Queue | None = queue.Queue() if stream else None
        self.cancelled = threading.Event()
        self.t0 = time.monotonic()
        self.first: list = [None] * len(requests)
        self.last: list = [None] * len(requests)
        self.ntok = [0] * len(requests)
        self.wake = None

    def token(self, k: int, tok: int) -> None:
        now = time.monotonic()
        if self.first[k] is None:
            self.first[k] = now
        self.last[k], self.ntok[k] = now, self.ntok[k] + 1
        if self.events is not None:
            self.events.put((k, tok))
        if self.wake is not None:
            self.wake()

    def finish(self, error: str | None = None) -> None:
        """Mark the job answered (``error``: the message of a 500 / an error event)."""
        self.error = error
        self.done.set()
        if self.events is not None:
            self.events.put(None)
        if self.wake is not None:
            self.wake()

    def waiting_rows(self) -> int:
        """Rows with no token yet (0 once done)."""
        return 0 if self.done.is_set() else sum(f is None for f in self.first)


class Front:
    """Rank 0's request side: validation, the job queue ``jobs`` the batcher reads, answers.
    ``tokenizer``: a ``tokenizers.Tokenizer`` (None in ``bench serve``, which builds jobs itself);
    ``chat``: a :class:`~zerotron.serve.chat.ChatTemplate` (None: the default template);
    ``context``: the model's block_size (longer prompts get 400; None: no limit)."""

    def __init__(self, tokenizer, eos_id, model_id: str, batching: str, chat=None, context: int | None = None):
        from .metrics import Metrics

        self.tok, self.eos_id, self.model_id, self.batching = tokenizer, eos_id, model_id, batching
        self.jobs: queue.Queue = queue.Queue()
        self.draining = threading.Event()
        self.stats = ServeStats()
        self.metrics = Metrics()
        self.live: set = set()  # jobs submitted and not yet accounted (queue depth)
        self.counter = 0
        self._chat = chat
        self.context = context

    @property
    def chat(self):
        if self._chat is None:
            from .chat import ChatTemplate

            first = self.eos_id if isinstance(self.eos_id, int) or self.eos_id is None else next(iter(self.eos_id), None)
            eos = self.tok.id_to_token(first) if self.tok is not None and first is not None else ""
            self._chat = ChatTemplate(None, eos or "")
        return self._chat

    def health(self) -> dict:
        s = self.stats
        return {"status": "draining" if self.draining.is_set() else "ok", "batching": self.batching,
                "batches": s.batches, "requests": s.requests, "steps": s.steps, "running": s.running,
                "cancelled_rows": s.cancelled_rows}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": 0,
                                            "owned_by": "zerotron"}]}

    def render_metrics(self) -> str:
        depth = sum(j.waiting_rows() for j in list(self.live))
        return self.metrics.render(depth, self.stats.running, self.stats.cancelled_rows, self.stats)

    def submit(self, body, chat: bool = False):
        """Validate ``body`` (a completions or, with ``chat``, a chat completions body) and enqueue
        its job; returns (settings dict, job). Raises RequestError (400 naming the field, 404
        another model, 503 while draining)."""
        from zerotron.inference import Request, SamplingParams

        if self.draining.is_set():
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        req = validate(ChatRequest if chat else CompletionRequest, body)
        check_model(req.model, self.model_id)
        c = sampling(req)
        if chat:
            try:
                prompts = [self.chat.render([{"role": m.role, "content": m.text()} for m in req.messages])]
            except ValueError as e:
                raise RequestError(str(e), param="messages") from None
            c["max_tokens"] = CHAT_MAX_TOKENS if c["max_tokens"] is None else c["max_tokens"]
        else:
            prompts = req.prompts()
            c["max_tokens"] = 16 if c["max_tokens"] is None else c["max_tokens"]  # OpenAI's default
        c["chat"], c["prompt_tokens"], reqs = chat, 0, []
        for i, text in enumerate(prompts):
            ids = self.tok.encode(text).ids
            if not ids:
                raise RequestError(f"prompt {i} is empty after tokenization", param="prompt")
            if self.context is not None and len(ids) > self.context:
                raise RequestError(f"prompt {i} has {len(ids)} tokens, more than the model's context of "
                                   f"{self.context} tokens (block_size): shorten it",
                                   param="messages" if chat else "prompt")
            c["prompt_tokens"] += len(ids)
            for j in range(c["n"]):  # choice j of prompt i: seed + i * n + j (zerotron generate's for n = 1)
                reqs.append(Request(ids, SamplingParams(max_tokens=c["max_tokens"], temperature=float(c["temperature"]),
                                                        top_k=c["top_k"], top_p=float(c["top_p"]),
                                                        seed=c["seed"] + i * c["n"] + j, stop=tuple(c["stop"]))))
        job = Job(reqs, c["stream"])
        self.live.add(job)
        self.jobs.put(job)
        return c, job

    def account(self, job) -> None:
        """Count a job that ended (answered, failed or cancelled) in the metrics, once."""
        if job in self.live:
            self.live.discard(job)
            if job.done.is_set() and not job.error:
                self.metrics.job(job)

    def finish_reason(self, new: list[int], stops: list[str]) -> str:
        stopped = cut_at_stop(self.tok.decode(new), stops)[1]
        return "stop" if stopped or (bool(new) and is_eos(new[-1], self.eos_id)) else "length"

    def head(self, chat: bool) -> dict:
        self.counter += 1
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{self.counter}", "created": int(time.time()),
                "model": self.model_id}

    @staticmethod
    def usage(c: dict, job) -> Usage:
        n_out = sum(len(new) for new in job.result)
        return Usage(prompt_tokens=c["prompt_tokens"], completion_tokens=n_out, total_tokens=c["prompt_tokens"] + n_out)

    def answer(self, c: dict, job) -> dict:
        """The JSON answer of a finished job (RequestError 500 if the engine failed). ``usage``
        counts each prompt once, however many choices ``n`` it has, and every choice's tokens."""
        if job.error:
            raise RequestError(job.error, status=500, code="internal_error")
        texts = [(cut_at_stop(self.tok.decode(new), c["stop"])[0], self.finish_reason(new, c["stop"]))
                 for new in job.result]
        if c["chat"]:
            return ChatCompletion(**self.head(True), usage=self.usage(c, job), choices=[
                ChatChoice(index=k, message={"content": t}, finish_reason=r) for k, (t, r) in enumerate(texts)
            ]).model_dump()
        return Completion(**self.head(False), usage=self.usage(c, job), choices=[
            CompletionChoice(text=t, index=k, finish_reason=r) for k, (t, r) in enumerate(texts)]).model_dump()


class Streamer:
    """The server-sent events of a streamed job: :meth:`start` (a chat's first chunk: the
    assistant role of every choice), :meth:`token` (one decoded token: the chunk of new text, if
    any), :meth:`end` (the rest of each choice with its finish_reason, then the usage chunk if
    ``stream_options.include_usage``; an ``error`` event if the engine failed). Each is a list of
    dicts to send as ``data: {json}``; the texts add up to the non-streamed answer."""

    def __init__(self, front: Front, c: dict, job: Job):
        self.front, self.c, self.job, self.chat = front, c, job, c["chat"]
        self.head = front.head(self.chat)
        self.texts = [StreamText(front.tok.decode, c["stop"]) for _ in job.requests]

    def _chunk(self, k: int, text: str | None, reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            d = ChatChunk(**self.head, choices=[ChatChunkChoice(index=k, delta=delta, finish_reason=reason)]
                          ).model_dump(exclude={"usage"})
            d["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # OpenAI sends only the fields set
            return d
        return Completion(**self.head, choices=[CompletionChoice(text=text or "", index=k, finish_reason=reason)]
                          ).model_dump(exclude={"usage"})

    def start(self) -> list[dict]:
        return [self._chunk(k, "", role=True) for k in range(len(self.texts))] if self.chat else []

    def token(self, k: int, tok: int) -> list[dict]:
        piece = self.texts[k].push(tok)
        return [self._chunk(k, piece)] if piece else []

    def end(self) -> list[dict]:
        job, c = self.job, self.c
        if job.error:
            return [{"error": {"message": job.error, "type": "server_error", "param": None, "code": "internal_error"}}]
        out = []
        for k, new in enumerate(job.result):  # tokens not streamed (other dp replicas), then the rest
            for tok in new[len(self.texts[k].tokens):]:
                self.texts[k].push(tok)
            rest = self.texts[k].finish()
            out.append(self._chunk(k, rest if rest or not self.chat else None,
                                   self.front.finish_reason(new, c["stop"])))
        if c["include_usage"]:
            u = self.front.usage(c, job).model_dump()
            out.append({**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "choices": [], "usage": u})
        return out
