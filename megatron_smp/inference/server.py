"""The OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra), on the leader rank.

    POST /v1/completions       prompt (string, list of strings, token ids or lists of them),
                               max_tokens, temperature, top_p, top_k, n, stop, seed, logprobs,
                               echo (with the prompt's log-probs), stream (server-sent events),
                               stop_token_ids, ignore_eos
    POST /v1/chat/completions  messages through the chat template; max_tokens /
                               max_completion_tokens, temperature, top_p, top_k, n, stop, seed,
                               logprobs, top_logprobs, stream
    GET  /v1/models, GET /health
    GET  /metrics              Prometheus text format (`inference.metrics`): requests running
                               and queued, tokens in and out, KV-cache blocks used, time to
                               first token and per output token, speculative acceptance
    PUT  /api                  Megatron's legacy API: prompts, tokens_to_generate, temperature,
                               top_k, top_p, logprobs, add_BOS, random_seed

Every request is checked before it reaches the engine: a malformed body, an unknown field, a
value out of range or a prompt longer than the context is a 400 with OpenAI's error JSON, and
the server goes on serving. The engine steps on its own thread (`EngineLoop`), which wakes the
other ranks for every step (and once a second when idle, so their collectives never time out);
a request's tokens reach its handler after every step, and a streaming client that disconnects
aborts its requests, which frees their cache blocks at the next step.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Union

from megatron_smp.config import ConfigError
from megatron_smp.inference.engine import InferenceEngine, Request
from megatron_smp.inference.sampling import SamplingParams
from megatron_smp.inference.text import TextCodec

try:
    from fastapi import FastAPI, Request as HttpRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ConfigDict

    from megatron_smp.inference.metrics import ServerMetrics
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError("the inference server needs FastAPI, uvicorn and prometheus_client: "
                      "pip install 'megatron_smp[serve]'") from error


class EngineLoop:
    """Steps the engine on a thread of its own and hands each request's progress to the
    asyncio loop that waits for it."""

    def __init__(self, engine: InferenceEngine, idle_interval: float = 1.0) -> None:
        self.engine = engine
        self.metrics = ServerMetrics(engine)
        self.idle_interval = idle_interval
        self._wake = threading.Event()
        self._stopping = False
        self._waiters: Dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="inference-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the loop and stop the other ranks' worker loops."""
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def submit(self, prompt: List[int], params: SamplingParams):
        """(request, asyncio.Queue of progress events) on the calling event loop."""
        if self.error is not None:
            raise RuntimeError(f"the inference engine stopped: {self.error}")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            request = self.engine.add_request(prompt, params)
            self._waiters[request.request_id] = (loop, queue)
            self.metrics.on_submit(request)
        self._wake.set()
        return request, queue

    def abort(self, request: Request) -> None:
        if not request.finished:
            self.engine.abort(request.request_id)
            self._wake.set()

    def _notify(self, request: Request) -> None:
        self.metrics.on_advance(request)
        with self._lock:
            waiter = self._waiters.get(request.request_id)
            if request.finished:
                self._waiters.pop(request.request_id, None)
        if waiter is not None:
            loop, queue = waiter
            loop.call_soon_threadsafe(queue.put_nowait, (len(request.output), request.finished))

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                if not engine.has_work:
                    self._wake.wait(self.idle_interval)
                    self._wake.clear()
                    if self._stopping:
                        break
                for request in engine.step() or []:
                    self._notify(request)
                with self._lock:  # aborted requests never advance again: wake their waiters
                    aborted = [self.engine.requests.get(i) for i in list(self._waiters)]
                for request_id in [i for i, r in zip(list(self._waiters), aborted) if r is None]:
                    loop, queue = self._waiters.pop(request_id)
                    loop.call_soon_threadsafe(queue.put_nowait, (None, True))
                    self.metrics.forget(request_id)
        except BaseException as error:  # surfaced to every later request
            self.error = error
            raise
        finally:
            engine.shutdown()


# Request bodies -----------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SamplingBody(_Body):
    """The fields completions and chat completions share (OpenAI's, and vLLM's top_k,
    stop_token_ids, ignore_eos)."""

    model: Optional[str] = None
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = -1
    n: int = 1
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: Optional[str] = None


class CompletionBody(_SamplingBody):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None


class ChatMessage(_Body):
    role: str
    content: str
    name: Optional[str] = None


class ChatBody(_SamplingBody):
    messages: List[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


class MegatronBody(_Body):
    prompts: List[str]
    tokens_to_generate: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    logprobs: bool = False
    add_BOS: bool = False
    random_seed: Optional[int] = None


def _stops(body) -> List[str]:
    return [body.stop] if isinstance(body.stop, str) else list(body.stop or [])


class BadRequest(Exception):
    """A request that cannot be served: 400 with OpenAI's error JSON."""


def _error(message: str, status: int = 400, kind: str = "invalid_request_error"):
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


# The server -------------------------------------------------------------------------------------


class CompletionServer:
    """Builds the FastAPI app over an `EngineLoop` and a `TextCodec`."""

    def __init__(self, engine: InferenceEngine, codec: TextCodec, model_name: str,
                 default_max_tokens: int = 16) -> None:
        self.engine = engine
        self.codec = codec
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.loop = EngineLoop(engine)
        engine.stop_checker = codec.stop_checker
        self.app = self._build_app()

    # -- sampling parameters

    def _params(self, body, max_tokens: Optional[int], logprobs: int,
                prompt_logprobs: bool = False, index: int = 0) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name) != 0.0:
                raise BadRequest(f"{name} is not supported (only 0)")
        if body.n < 1:
            raise BadRequest("n must be >= 1")
        top_k = body.top_k if body.top_k is not None else -1
        if top_k < -1:
            raise BadRequest("top_k must be -1 (off), 0 (off) or positive")
        stop = _stops(body)
        stop_ids = list(body.stop_token_ids or [])
        if not body.ignore_eos and self.codec.eos_id is not None:
            stop_ids.append(self.codec.eos_id)
        seed = None if body.seed is None else body.seed + index
        temperature = 1.0 if body.temperature is None else body.temperature
        try:
            return SamplingParams(
                max_new_tokens=self.default_max_tokens if max_tokens is None else max_tokens,
                temperature=temperature, top_k=max(top_k, 0),
                top_p=1.0 if body.top_p is None else body.top_p, seed=seed,
                stop_token_ids=stop_ids, stop=stop, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs).validate(self.engine.config.vocab_size)
        except ConfigError as error:
            raise BadRequest(str(error)) from error

    def _prompts(self, prompt) -> List[List[int]]:
        if isinstance(prompt, str):
            return [self.codec.encode(prompt)]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [self.codec.encode(p) if isinstance(p, str) else list(p) for p in prompt]

    def _submit_all(self, prompts, params_for) -> List[tuple]:
        """Check every request first (a bad one rejects the whole call), then submit."""
        jobs = []
        for prompt_index, prompt in enumerate(prompts):
            for choice, params in params_for(prompt_index):
                try:
                    self.engine.check_request(prompt, params)
                except ConfigError as error:
                    raise BadRequest(str(error)) from error
                jobs.append((choice, prompt, params))
        return [(choice, prompt, *self.loop.submit(prompt, params))
                for choice, prompt, params in jobs]

    # -- responses

    def _token_logprobs(self, request: Request, count: int, echo: bool, output_length: int,
                        prompt: List[int]):
        """OpenAI's completion `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_logprobs, tops = [], [], []
        if echo:
            tokens += prompt
            token_logprobs += request.prompt_logprobs or [None] * len(prompt)
            prompt_tops = request.prompt_top_logprobs or [[]] * len(prompt)
            tops += [None] + [dict((self.codec.token_text(t), lp) for t, lp in top)
                              for top in prompt_tops[1:]]
        tokens += request.output[:output_length]
        token_logprobs += request.logprobs[:output_length]
        tops += [dict((self.codec.token_text(t), lp) for t, lp in top)
                 for top in request.top_logprobs[:output_length]]
        texts = [self.codec.token_text(t) for t in tokens]
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {"tokens": texts, "token_logprobs": token_logprobs,
                "top_logprobs": tops if count else None, "text_offset": offsets}

    def _output_length(self, request: Request) -> int:
        """Tokens to report: all, less a trailing stop string's tokens is done in the text."""
        return len(request.output)

    def _completion_choice(self, choice: int, request: Request, prompt, body):
        text = self.codec.completion_text(request)
        if body.echo:
            text = self.codec.decode(prompt) + text
        logprobs = None
        if body.logprobs is not None:
            logprobs = self._token_logprobs(request, body.logprobs, body.echo,
                                            self._output_length(request), prompt)
        return {"index": choice, "text": text, "logprobs": logprobs,
                "finish_reason": request.finish_reason}

    @staticmethod
    def _usage(jobs) -> Dict[str, int]:
        prompt_tokens = sum(len(prompt) for _, prompt, _, _ in jobs)
        completion = sum(len(request.output) for _, _, request, _ in jobs)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    async def _wait(self, jobs, http: Optional[HttpRequest] = None) -> None:
        try:
            for _, _, request, queue in jobs:
                while not request.finished:
                    _, done = await queue.get()
                    if done:
                        break
        finally:
            for _, _, request, _ in jobs:
                self.loop.abort(request)

    def _held_back(self, stops: List[str]) -> int:
        """Characters a stream keeps back: a stop string may still be completing."""
        return max((len(s) for s in stops), default=1) - 1

    async def _stream(self, jobs, make_chunk, http: HttpRequest, stops: List[str]):
        """Server-sent events: one chunk per request per step with its new text, then each
        request's finish reason, then [DONE]; a disconnected client's requests are aborted."""
        sent = {choice: 0 for choice, *_ in jobs}
        hold = self._held_back(stops)
        pending = {choice: (request, queue) for choice, _, request, queue in jobs}
        try:
            while pending:
                waits = {asyncio.ensure_future(queue.get()): choice
                         for choice, (_, queue) in pending.items()}
                done, rest = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for future in rest:
                    future.cancel()
                for future in done:
                    choice = waits[future]
                    request, _ = pending[choice]
                    finished = future.result()[1] or request.finished
                    text = self.codec.completion_text(request)
                    end = len(text) if finished else max(len(text) - hold, sent[choice])
                    if end > sent[choice]:
                        piece = make_chunk(choice, text[sent[choice]:end], None)
                        yield f"data: {json.dumps(piece)}\n\n"
                        sent[choice] = end
                    if finished:
                        del pending[choice]
                        last = make_chunk(choice, "", request.finish_reason)
                        yield f"data: {json.dumps(last)}\n\n"
                if await http.is_disconnected():
                    return
            yield "data: [DONE]\n\n"
        finally:
            for _, _, request, _ in jobs:
                self.loop.abort(request)

    def _streaming(self, jobs, chunk, http: HttpRequest, body) -> StreamingResponse:
        return StreamingResponse(self._stream(jobs, chunk, http, _stops(body)),
                                 media_type="text/event-stream")

    # -- the app

    def _build_app(self) -> FastAPI:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def lifespan(app):
            self.loop.start()
            yield
            await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)

        app = FastAPI(title="megatron_smp inference", lifespan=lifespan)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, error: RequestValidationError):
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: "
                f"{e.get('msg')}" for e in error.errors())
            return _error(f"invalid request: {problems}")

        @app.exception_handler(BadRequest)
        async def bad(_, error: BadRequest):
            return _error(str(error))

        @app.get("/health")
        async def health():
            if self.loop.error is not None:
                return _error(f"engine stopped: {self.loop.error}", 503, "server_error")
            engine = self.engine
            health = {"status": "ok", "running": len(engine.running),
                      "waiting": len(engine.waiting), "aborted": engine.num_aborted}
            if hasattr(engine, "served"):  # data-parallel replicas: requests each took
                health["replicas"] = list(engine.served)
            health["cache"] = engine.memory_report()  # this rank's (its replica's)
            return health

        @app.get("/metrics")
        async def metrics():
            return Response(self.loop.metrics.exposition(),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                "created": 0, "owned_by": "megatron_smp"}]}

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, http: HttpRequest):
            self._check_model(body.model)
            prompts = self._prompts(body.prompt)
            if body.best_of not in (None, body.n):
                raise BadRequest("best_of must equal n (no ranking of candidates)")
            if body.stream and body.echo:
                raise BadRequest("echo with stream is not supported")
            logprobs = body.logprobs or 0

            def params_for(prompt_index):
                return [(prompt_index * body.n + i,
                         self._params(body, body.max_tokens, logprobs, body.echo and
                                      body.logprobs is not None, i)) for i in range(body.n)]

            jobs = self._submit_all(prompts, params_for)
            ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
            if body.stream:
                def chunk(choice, text, reason):
                    return {"id": ident, "object": "text_completion", "created": created,
                            "model": self.model_name, "choices": [
                                {"index": choice, "text": text, "logprobs": None,
                                 "finish_reason": reason}]}

                return self._streaming(jobs, chunk, http, body)
            await self._wait(jobs)
            choices = [self._completion_choice(choice, request, prompt, body)
                       for choice, prompt, request, _ in jobs]
            return {"id": ident, "object": "text_completion", "created": created,
                    "model": self.model_name, "choices": choices, "usage": self._usage(jobs)}

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, http: HttpRequest):
            self._check_model(body.model)
            if body.top_logprobs is not None and not body.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true")
            try:
                prompt = self.codec.chat([m.model_dump(exclude_none=True)
                                          for m in body.messages])
            except ConfigError as error:
                raise BadRequest(str(error)) from error
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
                else body.max_tokens
            count = body.top_logprobs or 0

            def params_for(_):
                return [(i, self._params(body, max_tokens, count, False, i))
                        for i in range(body.n)]

            jobs = self._submit_all([prompt], params_for)
            ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            if body.stream:
                def chunk(choice, text, reason):
                    delta = {"content": text} if reason is None else {}
                    return {"id": ident, "object": "chat.completion.chunk", "created": created,
                            "model": self.model_name, "choices": [
                                {"index": choice, "delta": delta, "logprobs": None,
                                 "finish_reason": reason}]}

                return self._streaming(jobs, chunk, http, body)
            await self._wait(jobs)
            choices = []
            for choice, _, request, _ in jobs:
                logprobs = None
                if body.logprobs:
                    logprobs = {"content": [
                        {"token": self.codec.token_text(t), "logprob": lp,
                         "top_logprobs": [{"token": self.codec.token_text(a), "logprob": alp}
                                          for a, alp in top]}
                        for t, lp, top in zip(request.output, request.logprobs,
                                              request.top_logprobs)]}
                text = self.codec.completion_text(request)
                choices.append({"index": choice, "message": {"role": "assistant",
                                                             "content": text},
                                "logprobs": logprobs, "finish_reason": request.finish_reason})
            return {"id": ident, "object": "chat.completion", "created": created,
                    "model": self.model_name, "choices": choices, "usage": self._usage(jobs)}

        @app.put("/api")
        async def megatron_api(body: MegatronBody):
            if not body.prompts:
                raise BadRequest("prompts must be a non-empty list")
            if body.tokens_to_generate < 0:
                raise BadRequest("tokens_to_generate must be >= 0")
            if body.top_k < 0 or not 0.0 <= body.top_p <= 1.0:
                raise BadRequest("top_k must be >= 0 and top_p in [0, 1]")
            prompts = []
            for text in body.prompts:
                ids = self.codec.encode(text)
                if body.add_BOS and self.codec.bos_id is not None:
                    ids = [self.codec.bos_id] + ids
                prompts.append(ids)
            stop = [self.codec.eos_id] if self.codec.eos_id is not None else []

            def params_for(index):
                try:  # Megatron's top_p 0.0 and top_k 0 mean "off"
                    return [(index, SamplingParams(
                        max_new_tokens=body.tokens_to_generate, temperature=body.temperature,
                        top_k=body.top_k, top_p=body.top_p or 1.0,
                        seed=None if body.random_seed is None else body.random_seed + index,
                        stop_token_ids=stop, prompt_logprobs=body.logprobs).validate())]
                except ConfigError as error:
                    raise BadRequest(str(error)) from error

            jobs = self._submit_all(prompts, params_for)
            await self._wait(jobs)
            texts, segments, logprobs = [], [], []
            for _, prompt, request, _ in jobs:
                tokens = prompt + request.output
                texts.append(self.codec.decode(tokens))
                segments.append([self.codec.token_text(t) for t in tokens])
                if body.logprobs:
                    logprobs.append((request.prompt_logprobs or [None])[1:] + request.logprobs)
            result: Dict[str, Any] = {"text": texts, "segments": segments}
            if body.logprobs:
                result["logprobs"] = logprobs
            return result

        return app

    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise BadRequest(f"model {model!r} is not served here; this server serves "
                             f"{self.model_name!r} (GET /v1/models)")


def serve(engine: InferenceEngine, codec: TextCodec, model_name: str, host: str = "127.0.0.1",
          port: int = 5000, ready=None) -> None:
    """Run the server on this (leader) rank until it is stopped (SIGINT / SIGTERM); the other
    ranks run `engine.worker_loop()` meanwhile. `ready(port)` is called once it listens."""
    import uvicorn

    server = CompletionServer(engine, codec, model_name)
    config = uvicorn.Config(server.app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    http = uvicorn.Server(config)
    if ready is not None:
        original = http.startup

        async def startup(sockets=None):
            await original(sockets=sockets)
            ready(http.servers[0].sockets[0].getsockname()[1] if http.servers else port)

        http.startup = startup
    http.run()


__all__ = ["CompletionServer", "EngineLoop", "serve"]
