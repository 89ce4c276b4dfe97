"""`gateway mock`: an OpenAI-compatible simulated model server.

It stands in for vLLM / OpenAI / Qianfan backends in tests, the demo and benchmarks: realistic
latency distributions and token pacing, seeded failure injection, runtime control over HTTP
(`/mock/*`) or in process (`MockServer`), and statistics on what it received.

Control endpoints (JSON): `GET /mock/stats`, `GET /mock/requests[?path=P&limit=N]`,
`GET|POST /mock/config` (POST patches `MockBehavior` fields), `POST /mock/reset`,
`POST /mock/crash {"for_s": 1.0}` (close the listening socket, drop every connection, come
back after `for_s`).

Like vLLM it can also hold a batch and a prefix cache (SPEC §15's reason to exist):

- `max_num_seqs` generations run at once; the rest wait inside the mock (not a 429);
- `prefix_cache` keeps an LRU of that many prompt prefixes (a hash of the first
  `prefix_chars` characters of the rendered messages, rendered as the gateway's affinity key
  renders them). Prefill costs `prefill_us_per_char` per character not in the cache, before
  the first token: a hit prefills only what follows the prefix, a miss the whole prompt;
- `GET /metrics` (server root) answers vLLM-style Prometheus text:
  `vllm:num_requests_waiting` (requests beyond `max_num_seqs`), `vllm:num_requests_running`,
  `vllm:gpu_cache_usage_perc` (LRU fill ratio), and prefix-cache query/hit counters (per
  request, where vLLM counts tokens).
- with `prefix_block_chars` > 0 the cache is vLLM's instead: an LRU of `prefix_cache` *blocks*
  of that many characters, each keyed by the prompt up to its end (vLLM's chained block
  hashes), full blocks only; a request reuses the longest cached run of its leading blocks and
  caches the rest. Its block size is its own (vLLM's 16 tokens are not the gateway's 64
  bytes), and `prefix_cached_chars` / `prefix_prompt_chars` count the cached share.

With `engine` set to a profile (`h100-7b`, `a100-7b`) generations run instead through a
continuous-batching engine model (`gateway.sim.engine`: one step loop, decodes first, prefill
chunks, KV blocks, preemption, a block prefix cache): the first content token comes after the
prompt's prefill, later tokens one per step, and a step slows with every running sequence.
`latency_ms`, `tokens_per_s` and the prefix options above do not apply to it; `max_num_seqs`
overrides the profile's; its `/metrics` are vLLM's (waiting, running, KV-cache usage under
both names, cache config, preemptions, prefix-cache tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import math
import random
import signal
import socket
import ssl
import struct
import sys
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any, Final, Literal, get_args

import msgspec
import orjson
from aiohttp import web

from gateway.affinity import render_prefix
from gateway.messages import message_chars
from gateway.sim.engine import PROFILES, Engine, EngineFull, Profile, Sequence, profile_with

__all__ = [
    "ENGINE_PROFILES",
    "FAIL_MODES",
    "LATENCY_DISTS",
    "FailMode",
    "LatencyDist",
    "MockBehavior",
    "MockServer",
    "MockStats",
    "add_arguments",
    "behavior_from_args",
    "run",
    "sample_latency_ms",
]

LatencyDist = Literal["fixed", "uniform", "exponential", "lognormal", "pareto"]
FailMode = Literal["status", "reset", "hang", "error200", "stall", "cut", "malformed"]
LATENCY_DISTS: Final[tuple[str, ...]] = get_args(LatencyDist)
FAIL_MODES: Final[tuple[str, ...]] = get_args(FailMode)
ENGINE_PROFILES: Final[tuple[str, ...]] = tuple(PROFILES)

# Shape parameters of the random latency distributions; each is scaled so its mean is
# `latency_ms`. Pareto with alpha 1.5 has a finite mean but infinite variance: a heavy tail.
_LOGNORMAL_SIGMA: Final = 0.5
_PARETO_ALPHA: Final = 1.5


class MockBehavior(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every knob of the simulated backend. Mutable; `MockServer.configure` validates a patch."""

    model: str = "mock-model"  # served by /v1/models (requests' `model` is echoed back)
    strict_model: bool = False  # answer 404 model_not_found to any other `model`, like vLLM
    latency_ms: float = 0.0  # mean delay before the first response byte
    latency_dist: LatencyDist = "fixed"
    latency_max_ms: float = 60_000.0  # cap on a sampled delay (the pareto tail is unbounded)
    tokens_per_s: float = 0.0  # generation pace after the first token; 0 = unpaced
    default_tokens: int = 16  # completion length when the request gives no max_tokens
    max_tokens_cap: int = 4096  # ceiling on a requested max_tokens
    fail_rate: float = 0.0  # probability that a generation request fails (seeded)
    fail_every: int = 0  # also fail every N-th generation request; 0 = off
    fail_mode: FailMode = "status"
    fail_status: int = 500  # HTTP status of the `status` failure mode
    retry_after_s: float | None = None  # Retry-After on `status` failures
    fail_after_chunks: int = 2  # SSE events (role chunk included) before stall/cut/malformed
    max_concurrency: int = 0  # beyond this many generation requests answer 429; 0 = off
    down: bool = False  # abort every connection (except /mock/*) without an answer
    embedding_dim: int = 8
    seed: int | None = None  # seeds failure and latency draws and the generated text
    log_size: int = 100  # how many requests /mock/requests keeps
    # vLLM-like batch: generations running at once, the rest wait (not 429); 0 = unlimited
    max_num_seqs: int = 0
    prefix_cache: int = 0  # prompt prefixes kept (LRU); 0 = no prefix cache
    prefix_chars: int = 2048  # how much of the rendered prompt a prefix covers
    prefill_us_per_char: float = 0.0  # prefill cost of each prompt character not cached
    # > 0: `prefix_cache` counts blocks of this many characters (vLLM's block cache)
    prefix_block_chars: int = 0
    # The continuous-batching engine model (gateway.sim.engine); "" = off
    engine: str = ""  # a profile: h100-7b | a100-7b
    kv_tokens: int = 0  # KV cache size in tokens; 0 = the profile's
    max_num_batched_tokens: int = 0  # tokens per step; 0 = the profile's
    speed: float = 1.0  # this instance's speed: 3 = three times faster, 0.5 = twice as slow
    time_factor: float = 1.0  # drift, changed at runtime: 2 = every step takes twice as long
    knee: int = 0  # past this many running sequences ...
    knee_ms: float = 0.0  # ... each one more adds this to every step (0 = no knee)
    max_waiting: int = 1024  # the engine's waiting queue bound; beyond it 503

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be within [0, 1]")
        if not 100 <= self.fail_status <= 599:
            raise ValueError("fail_status must be an HTTP status")
        nonneg = (
            "latency_ms",
            "latency_max_ms",
            "tokens_per_s",
            "fail_every",
            "max_concurrency",
            "max_num_seqs",
            "prefix_cache",
            "prefill_us_per_char",
            "prefix_block_chars",
            "kv_tokens",
            "max_num_batched_tokens",
            "knee",
            "knee_ms",
            "max_waiting",
        )
        for name in nonneg:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.engine and self.engine not in PROFILES:
            raise ValueError(f"engine must be one of {', '.join(PROFILES)} (or empty)")
        if not (self.speed > 0.0 and self.time_factor > 0.0):
            raise ValueError("speed and time_factor must be > 0")
        if self.kv_tokens and self.kv_tokens < 16:
            raise ValueError("kv_tokens must be 0 (the profile's) or >= 16")
        if self.default_tokens < 1 or self.max_tokens_cap < 1 or self.embedding_dim < 1:
            raise ValueError("default_tokens, max_tokens_cap and embedding_dim must be >= 1")
        if self.fail_after_chunks < 0 or self.log_size < 0:
            raise ValueError("fail_after_chunks and log_size must be >= 0")
        if self.prefix_chars < 1:
            raise ValueError("prefix_chars must be >= 1")


class MockStats(msgspec.Struct, kw_only=True):
    """Counters since start or the last reset. Outcomes count every non-control request."""

    requests_total: int = 0
    by_path: dict[str, int] = msgspec.field(default_factory=dict)
    by_status: dict[str, int] = msgspec.field(default_factory=dict)  # of answered requests
    in_flight: int = 0  # generation requests (POST /v1/...) being handled now
    peak_in_flight: int = 0
    completed: int = 0  # the handler produced an answer (any status)
    aborted: int = 0  # the mock dropped the connection on purpose (reset, cut, down, crash)
    cancelled: int = 0  # the client went away while the request was being handled
    rejected: int = 0  # 429 beyond max_concurrency (also counted in completed)
    injected: dict[str, int] = msgspec.field(default_factory=dict)  # failures per mode
    prompt_tokens: int = 0  # usage of successful generations
    completion_tokens: int = 0
    waiting: int = 0  # generations waiting for one of max_num_seqs
    peak_waiting: int = 0
    prefix_hits: int = 0  # generations whose prompt prefix was cached
    prefix_misses: int = 0
    prefix_cached_chars: int = 0  # block cache: prompt characters found cached
    prefix_prompt_chars: int = 0  # block cache: prompt characters looked up


def sample_latency_ms(rng: random.Random, b: MockBehavior) -> float:
    """One delay draw from `b.latency_dist` with mean `b.latency_ms`, capped."""
    mean = b.latency_ms
    if mean <= 0.0:
        return 0.0
    dist = b.latency_dist
    if dist == "fixed":
        value = mean
    elif dist == "uniform":
        value = rng.uniform(0.5 * mean, 1.5 * mean)
    elif dist == "exponential":
        value = rng.expovariate(1.0 / mean)
    elif dist == "lognormal":
        value = rng.lognormvariate(math.log(mean) - _LOGNORMAL_SIGMA**2 / 2, _LOGNORMAL_SIGMA)
    else:
        value = rng.paretovariate(_PARETO_ALPHA) * mean * (_PARETO_ALPHA - 1) / _PARETO_ALPHA
    return min(value, b.latency_max_ms)


# ---- pre-encoded constant parts ------------------------------------------------------------

_CORPUS: Final = (
    "the loop visits each element once so the code runs in linear time and the answer is "
    "correct because every branch returns a value while the compiler accepts this program "
    "but a nested scan would make it quadratic in the worst case for large input arrays"
)
_WORDS: Final = tuple(_CORPUS.split())
_WORDS_SP: Final = tuple(" " + w for w in _WORDS)
_TOK_FIRST: Final = tuple(orjson.dumps(w) for w in _WORDS)
_TOK_NEXT: Final = tuple(orjson.dumps(w) for w in _WORDS_SP)
_CHUNK_END: Final = b',"logprobs":null,"finish_reason":null}]}'
_SSE_HEADERS: Final = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_JSON_CT: Final = "application/json"
_DONE: Final = b"data: [DONE]\n\n"
_MALFORMED_LINE: Final = b"data: {not json\n\n"
_QIANFAN_LIMIT: Final = orjson.dumps(
    {"error_code": 336501, "error_msg": "Open api daily request limit reached"}
)
_CHAT_ROLE: Final = (
    b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
)
_GEN_PATHS: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text",
    "/v1/embeddings": "embed",
}
_GET_PATHS: Final = frozenset({"/v1/models", "/health", "/metrics"})
_ERROR_TYPES: Final[dict[int, tuple[str, str | None]]] = {
    400: ("invalid_request_error", "invalid_request"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
}
_RST: Final = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a TCP RST


def _error_body(status: int, message: str, code: str | None = None) -> bytes:
    default = ("invalid_request_error", None) if status < 500 else ("server_error", None)
    etype, ecode = _ERROR_TYPES.get(status, default)
    err = {"message": message, "type": etype, "param": None, "code": code or ecode}
    return orjson.dumps({"error": err})


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type=_JSON_CT)


def _prompt_tokens(body: dict[str, Any], kind: str) -> int:
    """≈ chars/4, the usual rule of thumb for English BPE vocabularies."""
    chars = 0
    if kind == "chat":
        chars = message_chars(body.get("messages"))
    else:
        prompt = body.get("prompt") if kind == "text" else body.get("input")
        items = prompt if isinstance(prompt, list) else [prompt]
        for item in items:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, int):
                chars += 4  # a token id
            elif isinstance(item, list):
                chars += 4 * len(item)
    return max(1, (chars + 3) // 4)


def _embedding(text: str, dim: int, seed: int | None) -> list[float]:
    # Seeding Random with a str hashes it with SHA-512: stable across processes, unlike hash().
    rng = random.Random(f"{seed}:{text}")
    vec = [rng.uniform(-1.0, 1.0) for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [round(x / norm, 6) for x in vec]


class _Call:
    """One request being handled, so a crash or stop can reach it."""

    __slots__ = ("aborted", "request", "task")

    def __init__(self, request: web.BaseRequest) -> None:
        self.request = request
        self.task = asyncio.current_task()
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True
        _abort_transport(self.request.transport)


def _abort_transport(transport: asyncio.Transport | None) -> None:
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    transport.abort()


class MockServer:
    """The simulated backend. `async with MockServer(MockBehavior(...)) as m:` then use `m.url`."""

    def __init__(
        self,
        behavior: MockBehavior | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.behavior = behavior if behavior is not None else MockBehavior()
        self.host = host
        self.port = port
        # HTTPS when given (an OpenAI-like TLS upstream for tests and benchmarks).
        self.ssl_context = ssl_context
        self.stats = MockStats()
        self._log: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=self.behavior.log_size
        )
        self._rng = random.Random(self.behavior.seed)
        self._gen_seq = 0  # generation requests seen: fail_every and response ids
        self._live: set[_Call] = set()
        self._runner: web.ServerRunner | None = None
        self._site: web.TCPSite | None = None
        self._crash_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._models_cache: tuple[str, bytes] = ("", b"")
        # vLLM-like batch and prefix cache (see the module docstring)
        self._seqs: asyncio.Semaphore | None = None
        self._seqs_size = 0
        self._running = 0
        self._prefixes: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._engine: Engine | None = None  # with `behavior.engine`, made on first use

    # ---- lifecycle and in-process control -------------------------------------------------

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL, e.g. `http://127.0.0.1:PORT/v1`."""
        return self.base_url + "/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The request log, oldest first (see `GET /mock/requests`)."""
        return list(self._log)

    @property
    def refusing(self) -> bool:
        """True while the listening socket is closed (`set_down(True)` or a crash)."""
        return self._runner is not None and self._site is None

    async def start(self) -> int:
        """Bind and serve; returns the bound port."""
        # handler_cancellation: a client that goes away cancels its handler, as a real
        # backend stops generating; it is what `stats.cancelled` counts.
        server = web.Server(
            self._handle, handler_cancellation=True, access_log=None, request_factory=_echoing
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=1.0)
        await self._runner.setup()
        self._stopping = False
        await self._listen()
        return self.port

    async def _listen(self) -> None:
        assert self._runner is not None
        site = web.TCPSite(
            self._runner, self.host, self.port, reuse_address=True, ssl_context=self.ssl_context
        )
        await site.start()
        self._site = site
        if self.port == 0:
            self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """Stop serving; hanging and stalled requests are cancelled."""
        if self._runner is None:
            return
        self._stopping = True
        if self._crash_task is not None:
            self._crash_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._crash_task
            self._crash_task = None
        for call in list(self._live):
            if call.task is not None:
                call.task.cancel()
        await self._runner.cleanup()
        self._runner = None
        self._site = None
        if self._engine is not None:
            await self._engine.close()
            self._engine = None

    async def __aenter__(self) -> MockServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def set_down(self, down: bool) -> None:
        """Crash (close the listener, drop all connections: clients get refused) or come back."""
        if self._runner is None:
            raise RuntimeError("MockServer is not started")
        if down and self._site is not None:
            await self._site.stop()
            self._site = None
            for call in list(self._live):
                call.abort()
            server = self._runner.server
            for conn in server.connections if server is not None else ():
                _abort_transport(conn.transport)
        elif not down and self._site is None:
            await self._listen()

    def configure(self, **patch: Any) -> MockBehavior:
        """Validate and apply a partial update of the behaviour; a new `seed` reseeds."""
        merged = msgspec.structs.asdict(self.behavior) | patch
        new = msgspec.convert(merged, MockBehavior)
        if "seed" in patch:
            self._rng.seed(new.seed)
        if new.log_size != self._log.maxlen:
            self._log = collections.deque(self._log, maxlen=new.log_size)
        while len(self._prefixes) > new.prefix_cache:
            self._prefixes.popitem(last=False)
        self.behavior = new
        if self._engine is not None and new.engine:
            self._engine.reconfigure(self._profile(new), **self._engine_knobs(new))
        return new

    @staticmethod
    def _profile(b: MockBehavior) -> Profile:
        return profile_with(
            b.engine,
            max_num_seqs=b.max_num_seqs,
            kv_tokens=b.kv_tokens,
            max_num_batched_tokens=b.max_num_batched_tokens,
        )

    @staticmethod
    def _engine_knobs(b: MockBehavior) -> dict[str, Any]:
        return {
            "speed": b.speed,
            "time_factor": b.time_factor,
            "knee": b.knee,
            "knee_ms": b.knee_ms,
            "max_waiting": b.max_waiting,
        }

    @property
    def engine(self) -> Engine | None:
        """The engine model (None until the first generation with `behavior.engine`)."""
        return self._engine

    def _engine_for(self, b: MockBehavior) -> Engine:
        if self._engine is None:
            self._engine = Engine(self._profile(b), seed=b.seed, **self._engine_knobs(b))
        return self._engine

    def reset(self) -> None:
        """Clear stats and the request log; reseed so a seeded run repeats exactly."""
        in_flight = self.stats.in_flight
        waiting = self.stats.waiting
        self.stats = MockStats(
            in_flight=in_flight, peak_in_flight=in_flight, waiting=waiting, peak_waiting=waiting
        )
        self._log.clear()
        self._prefixes.clear()
        self._gen_seq = 0
        self._rng.seed(self.behavior.seed)

    def before_generation(self) -> None:
        """Called as each generation request arrives, before it counts in `stats.in_flight`;
        does nothing. A subclass may `configure()` the behaviour from the load here (the
        benchmarks' load-sensitive backends do)."""

    # ---- request handling -----------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path.startswith("/mock/"):
            return await self._control(request, path)
        kind = _GEN_PATHS.get(path)
        gen = kind is not None and request.method == "POST"
        if gen:
            self.before_generation()
        st = self.stats
        b = self.behavior
        st.requests_total += 1
        key = path if kind is not None or path in _GET_PATHS else "other"
        st.by_path[key] = st.by_path.get(key, 0) + 1
        call = _Call(request)
        if gen:
            if b.max_concurrency and st.in_flight >= b.max_concurrency:
                st.rejected += 1
                self._record(request, None, 0.0, "max_concurrency")
                return self._count(call, self._err(429, "mock max_concurrency reached"))
            st.in_flight += 1
            if st.in_flight > st.peak_in_flight:
                st.peak_in_flight = st.in_flight
        self._live.add(call)
        try:
            if b.down:
                self._record(request, None, 0.0, "down")
                return self._abort(call, web.Response())
            if gen:
                assert kind is not None
                if b.engine:  # the engine queues and batches by itself
                    resp = await self._generate(request, call, kind, b)
                else:
                    async with self._seq_slot(b):
                        resp = await self._generate(request, call, kind, b)
            else:
                resp = self._simple(request, path, b)
        except asyncio.CancelledError:
            if call.aborted:
                st.aborted += 1
            elif not self._stopping:
                st.cancelled += 1
            raise
        except ConnectionError:
            # A write hit a connection the client closed (the cancellation comes just after).
            if call.aborted:
                st.aborted += 1
            else:
                st.cancelled += 1
            return web.Response()
        finally:
            self._live.discard(call)
            if gen:
                st.in_flight -= 1
        return self._count(call, resp)

    @contextlib.asynccontextmanager
    async def _seq_slot(self, b: MockBehavior) -> AsyncIterator[None]:
        """One of `max_num_seqs` running slots, waited for in arrival order (vLLM's scheduler
        queues what its batch cannot take)."""
        if b.max_num_seqs and (self._seqs is None or self._seqs_size != b.max_num_seqs):
            # (re)sized by a reconfigure: holders of the old one release the old one
            self._seqs, self._seqs_size = asyncio.Semaphore(b.max_num_seqs), b.max_num_seqs
        seqs = self._seqs if b.max_num_seqs else None
        st = self.stats
        if seqs is not None and seqs.locked():
            st.waiting += 1
            st.peak_waiting = max(st.peak_waiting, st.waiting)
            try:
                await seqs.acquire()
            finally:
                self.stats.waiting -= 1
        elif seqs is not None:
            await seqs.acquire()
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            if seqs is not None:
                seqs.release()

    def _prefill_ms(self, body: dict[str, Any], b: MockBehavior) -> float:
        """Prefill time of a prompt: its characters not in the prefix cache, at
        `prefill_us_per_char` each; looks the prefix up (and caches it) on the way."""
        if not b.prefix_cache and not b.prefill_us_per_char:
            return 0.0
        prompt = render_prefix(body, 1 << 30)
        uncached = len(prompt)
        if b.prefix_cache and b.prefix_block_chars:
            uncached -= self._block_lookup(prompt, b)
        elif b.prefix_cache:
            prefix = prompt[: b.prefix_chars]
            if prefix in self._prefixes:
                self._prefixes.move_to_end(prefix)
                self.stats.prefix_hits += 1
                uncached -= len(prefix)
            else:
                self.stats.prefix_misses += 1
                self._prefixes[prefix] = None
                if len(self._prefixes) > b.prefix_cache:
                    self._prefixes.popitem(last=False)
        return uncached * b.prefill_us_per_char / 1000.0

    def _block_lookup(self, prompt: str, b: MockBehavior) -> int:
        """The block cache: the cached characters of `prompt`'s leading full blocks; caches
        the rest (and refreshes the used ones)."""
        size = b.prefix_block_chars
        keys = [prompt[: k + size] for k in range(0, len(prompt) - size + 1, size)]
        cached = 0
        for key in keys:
            if key not in self._prefixes:
                break
            cached += size
        self.stats.prefix_prompt_chars += len(prompt)
        self.stats.prefix_cached_chars += cached
        if cached:
            self.stats.prefix_hits += 1
        else:
            self.stats.prefix_misses += 1
        # Tail first, as vLLM frees a sequence's blocks: the head is evicted last.
        for key in reversed(keys):
            self._prefixes[key] = None
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > b.prefix_cache:
            self._prefixes.popitem(last=False)
        return cached

    def cached_chars(self, body: dict[str, Any]) -> int:
        """How many leading characters of `body`'s prompt the block cache holds now (an
        oracle's view of this instance; nothing changes)."""
        size = self.behavior.prefix_block_chars
        if not size:
            return 0
        prompt = render_prefix(body, 1 << 30)
        cached = 0
        for k in range(0, len(prompt) - size + 1, size):
            if prompt[: k + size] not in self._prefixes:
                break
            cached += size
        return cached

    def _note_waiting(self) -> None:
        st, engine = self.stats, self._engine
        if engine is not None:
            st.waiting = len(engine.waiting)
            st.peak_waiting = max(st.peak_waiting, st.waiting)

    def _engine_metrics(self, engine: Engine, label: str) -> bytes:
        """vLLM's names for the engine model's state (both KV-usage names: the gateway reads
        either, SPEC §15) and its cache config (`num_gpu_blocks` × 16-token blocks)."""
        usage = engine.usage()
        rows = (
            (
                "num_requests_running",
                "gauge",
                "Requests in the running batch.",
                len(engine.running),
            ),
            (
                "num_requests_waiting",
                "gauge",
                "Requests waiting to be scheduled.",
                len(engine.waiting),
            ),
            ("kv_cache_usage_perc", "gauge", "KV-cache usage; 1 means 100 percent.", usage),
            ("gpu_cache_usage_perc", "gauge", "KV-cache usage (deprecated name).", usage),
            ("num_preemptions_total", "counter", "Cumulative preemptions.", engine.preemptions),
            (
                "prefix_cache_queries_total",
                "counter",
                "Prefix-cache queried tokens.",
                engine.prefix_queries,
            ),
            ("prefix_cache_hits_total", "counter", "Prefix-cache hit tokens.", engine.prefix_hits),
        )
        lines = []
        for name, kind, help_text, value in rows:
            lines += [
                f"# HELP vllm:{name} {help_text}",
                f"# TYPE vllm:{name} {kind}",
                f"vllm:{name}{label} {float(value)}",
            ]
        lines += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{engine.total_blocks}"}} 1.0',
        ]
        return ("\n".join(lines) + "\n").encode()

    def metrics_text(self) -> bytes:
        """vLLM-style Prometheus text: the gauges the gateway reads (SPEC §15) and counters."""
        b, st = self.behavior, self.stats
        label = "{model_name=" + orjson.dumps(b.model).decode() + "}"
        if b.engine:
            return self._engine_metrics(self._engine_for(b), label)
        usage = len(self._prefixes) / b.prefix_cache if b.prefix_cache else 0.0
        rows = (
            ("num_requests_running", "gauge", "Requests in the running batch.", self._running),
            ("num_requests_waiting", "gauge", "Requests waiting for the batch.", st.waiting),
            ("gpu_cache_usage_perc", "gauge", "KV-cache usage; 1 means 100 percent.", usage),
            (
                "prefix_cache_queries_total",
                "counter",
                "Prefix-cache lookups (requests).",
                st.prefix_hits + st.prefix_misses,
            ),
            ("prefix_cache_hits_total", "counter", "Prefix-cache hits (requests).", st.prefix_hits),
        )
        lines = []
        for name, kind, help_text, value in rows:
            lines += [
                f"# HELP vllm:{name} {help_text}",
                f"# TYPE vllm:{name} {kind}",
                f"vllm:{name}{label} {float(value)}",
            ]
        if b.prefix_cache and b.prefix_block_chars:
            # vLLM's cache config: its KV cache in 16-token blocks (at 4 characters a token)
            blocks = max(1, b.prefix_cache * b.prefix_block_chars // 64)
            lines += [
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.",
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0',
            ]
        return ("\n".join(lines) + "\n").encode()

    def _count(self, call: _Call, resp: web.StreamResponse) -> web.StreamResponse:
        st = self.stats
        if call.aborted:
            st.aborted += 1
        else:
            st.completed += 1
            status = str(resp.status)
            st.by_status[status] = st.by_status.get(status, 0) + 1
        return resp

    def _abort(self, call: _Call, resp: web.StreamResponse) -> web.StreamResponse:
        # aiohttp then fails to write `resp` on the dead transport and drops it silently.
        call.abort()
        return resp

    def _err(self, status: int, message: str, code: str | None = None) -> web.Response:
        return web.Response(
            body=_error_body(status, message, code), status=status, content_type=_JSON_CT
        )

    def _simple(self, request: web.BaseRequest, path: str, b: MockBehavior) -> web.Response:
        self._record(request, None, 0.0, None)
        if path not in _GET_PATHS and path not in _GEN_PATHS:
            return self._err(404, f"no route {path}", "not_found")
        if request.method != "GET" or path not in _GET_PATHS:
            return self._err(405, f"method {request.method} not allowed", "method_not_allowed")
        if path == "/health":
            return web.Response()
        if path == "/metrics":
            return web.Response(body=self.metrics_text(), content_type="text/plain")
        if self._models_cache[0] != b.model:
            card = {"id": b.model, "object": "model", "created": 0, "owned_by": "mock"}
            self._models_cache = (b.model, orjson.dumps({"object": "list", "data": [card]}))
        return web.Response(body=self._models_cache[1], content_type=_JSON_CT)

    def _record(
        self, request: web.BaseRequest, body: Any, latency_ms: float, fail: str | None
    ) -> None:
        if self._log.maxlen:
            self._log.append(
                {
                    "time": time.time(),
                    "method": request.method,
                    "path": request.path,
                    "query": request.query_string,
                    "headers": {k.lower(): v for k, v in request.headers.items()},
                    "body": body,
                    "latency_ms": latency_ms,
                    "fail": fail,
                }
            )

    def _decide(self, request: web.BaseRequest, b: MockBehavior) -> tuple[str | None, int, float]:
        """The failure mode (or None), its status and the first-byte delay for one request."""
        headers = request.headers
        status = b.fail_status
        fail: str | None = None
        # Draw from the RNG whatever the overrides say, so a seeded sequence stays aligned.
        drawn = self._rng.random() if b.fail_rate > 0.0 else 1.0
        latency = sample_latency_ms(self._rng, b)
        if (b.fail_every and self._gen_seq % b.fail_every == 0) or drawn < b.fail_rate:
            fail = b.fail_mode
        forced = headers.get("X-Mock-Fail")
        if forced is not None:
            fail = None if forced == "none" else forced
        forced_status = headers.get("X-Mock-Status")
        if forced_status is not None:
            with contextlib.suppress(ValueError):
                status = int(forced_status)
                fail = "status" if status >= 300 else None
        forced_latency = headers.get("X-Mock-Latency-Ms")
        if forced_latency is not None:
            with contextlib.suppress(ValueError):
                latency = max(0.0, float(forced_latency))
        return fail, status, latency

    async def _generate(
        self, request: web.BaseRequest, call: _Call, kind: str, b: MockBehavior
    ) -> web.StreamResponse:
        raw = await request.read()
        self._gen_seq += 1
        seq = self._gen_seq
        body: Any
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        fail, status, latency_ms = self._decide(request, b)
        if fail is not None and fail not in FAIL_MODES:
            fail = "status"
        self._record(request, body, latency_ms, fail)
        if not isinstance(body, dict):
            return self._err(400, "the body must be a JSON object")
        field = {"chat": "messages", "text": "prompt", "embed": "input"}[kind]
        if body.get(field) is None or (kind == "chat" and not isinstance(body[field], list)):
            return self._err(400, f"'{field}' is required", "invalid_request")
        model = body.get("model")
        if not isinstance(model, str) or (b.strict_model and model != b.model):
            return self._err(404, f"The model `{model}` does not exist.")
        if fail is not None:
            self.stats.injected[fail] = self.stats.injected.get(fail, 0) + 1
        if kind != "embed" and not b.engine:
            latency_ms += self._prefill_ms(body, b)
        if latency_ms > 0.0:
            await asyncio.sleep(latency_ms / 1000.0)
        if fail == "status":
            return self._fail_status(status, b.retry_after_s)
        if fail == "reset":
            return self._abort(call, web.Response())
        if fail == "hang":
            await _forever()  # until the client gives up
        if fail == "error200":
            return web.Response(body=_QIANFAN_LIMIT, content_type=_JSON_CT)
        prompt_tokens = _prompt_tokens(body, kind)
        if kind == "embed":
            resp = await self._embed(request, call, body, model, prompt_tokens, fail, b)
            n = 0
        else:
            requested = body.get("max_completion_tokens") or body.get("max_tokens")
            if isinstance(requested, int) and requested > 0:
                n, finish = min(requested, b.max_tokens_cap), "length"
            else:
                n, finish = b.default_tokens, "stop"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
            usage["total_tokens"] = prompt_tokens + n
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + f"mock{seq:08d}"
            # The text depends on the prompt alone: streamed or not, the same question gets
            # the same answer, and a shorter max_tokens gets a prefix of it.
            words = _token_ids(orjson.dumps(body[field]), n, b.seed)
            eseq: Sequence | None = None
            if b.engine:
                try:
                    prompt = render_prefix(body, 1 << 30)
                    eseq = self._engine_for(b).submit(prompt, prompt_tokens, n)
                except EngineFull:
                    return self._err(503, "mock engine: the waiting queue is full", "overloaded")
                except ValueError as exc:
                    return self._err(400, f"mock engine: {exc}", "context_length_exceeded")
                self._note_waiting()
            try:
                if body.get("stream") is True:
                    opts = body.get("stream_options")
                    with_usage = isinstance(opts, dict) and opts.get("include_usage") is True
                    head = _chunk_head(rid, kind, model)
                    final = usage if with_usage else None
                    resp = await self._stream(
                        request, call, kind, head, words, finish, final, b, fail, eseq
                    )
                else:
                    payload = _completion(rid, kind, model, words, finish, usage)
                    if eseq is not None:
                        await _tokens(eseq, n)
                    elif b.tokens_per_s > 0.0:
                        await asyncio.sleep((n - 1) / b.tokens_per_s)
                    resp = await self._send_json(request, call, payload, fail)
            finally:
                if eseq is not None and self._engine is not None:
                    self._engine.abandon(eseq)  # a no-op once it finished
        if fail is None:
            self.stats.prompt_tokens += prompt_tokens
            self.stats.completion_tokens += n
        return resp

    def _fail_status(self, status: int, retry_after_s: float | None) -> web.Response:
        resp = self._err(status, f"mock injected failure: HTTP {status}")
        if retry_after_s is not None:
            resp.headers["Retry-After"] = str(math.ceil(retry_after_s))
            # The openai clients honour this finer header before Retry-After.
            resp.headers["retry-after-ms"] = str(round(retry_after_s * 1000))
        return resp

    async def _send_json(
        self, request: web.BaseRequest, call: _Call, payload: bytes, fail: str | None
    ) -> web.StreamResponse:
        """A JSON answer, or its broken variants for the stream-shaped failure modes."""
        if fail == "malformed":
            return web.Response(body=b"{not json", content_type=_JSON_CT)
        if fail not in ("stall", "cut"):
            return web.Response(body=payload, content_type=_JSON_CT)
        resp = web.StreamResponse(headers={"Content-Type": _JSON_CT})
        resp.content_length = len(payload)
        await resp.prepare(request)
        await resp.write(payload[: len(payload) // 2])
        if fail == "cut":
            return self._abort(call, resp)
        await _forever()
        raise AssertionError("unreachable")

    async def _stream(
        self,
        request: web.BaseRequest,
        call: _Call,
        kind: str,
        head: bytes,
        words: list[int],
        finish: str,
        usage: dict[str, int] | None,
        b: MockBehavior,
        fail: str | None,
        seq: Sequence | None = None,
    ) -> web.StreamResponse:
        """SSE: one event per token, each written (flushed) on its own, paced at tokens_per_s
        or, with an engine sequence, as the engine produces them (the role chunk goes with
        the first token, after the prefill, as vLLM sends it)."""
        chat = kind == "chat"
        lines = [head + _CHAT_ROLE] if chat else []
        first = len(lines)
        pre = b'{"index":0,"delta":{"content":' if chat else b'{"index":0,"text":'
        post = b"}" + _CHUNK_END if chat else _CHUNK_END
        lines.append(head + pre + _TOK_FIRST[words[0]] + post)
        lines.extend(head + pre + _TOK_NEXT[w] + post for w in words[1:])
        last = len(lines)
        end = b'{"index":0,"delta":{},' if chat else b'{"index":0,"text":"",'
        lines.append(head + end + b'"logprobs":null,"finish_reason":"' + finish.encode() + b'"}]}')
        if usage is not None:
            lines.append(head + b'],"usage":' + orjson.dumps(usage) + b"}")
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        interval = 1.0 / b.tokens_per_s if b.tokens_per_s > 0.0 and seq is None else 0.0
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        broken = fail in ("stall", "cut", "malformed")
        for i, line in enumerate(lines):
            if broken and i == b.fail_after_chunks:
                break
            if seq is not None:
                await _tokens(seq, min(max(i - first + 1, 1), len(words)))
            elif interval and first < i < last:
                # Absolute deadlines, so the pace does not drift with write and wake-up costs.
                delay = t0 + (i - first) * interval - loop.time()
                if delay > 0.0:
                    await asyncio.sleep(delay)
            await resp.write(b"data: " + line + b"\n\n")
        else:
            await resp.write(_DONE)
            return resp
        if fail == "malformed":
            await resp.write(_MALFORMED_LINE)
            return resp
        if fail == "cut":
            return self._abort(call, resp)
        await _forever()  # stall: the connection stays open, silent
        raise AssertionError("unreachable")

    async def _embed(
        self,
        request: web.BaseRequest,
        call: _Call,
        body: dict[str, Any],
        model: str,
        prompt_tokens: int,
        fail: str | None,
        b: MockBehavior,
    ) -> web.StreamResponse:
        inputs = body["input"]
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        as_b64 = body.get("encoding_format") == "base64"
        dim = body.get("dimensions")
        if not (isinstance(dim, int) and 0 < dim <= 4096):
            dim = b.embedding_dim
        data = []
        for i, item in enumerate(inputs):
            key = item if isinstance(item, str) else orjson.dumps(item).decode()
            vec: Any = _embedding(key, dim, b.seed)
            if as_b64:  # what the openai client asks for by default: little-endian float32
                vec = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vec})
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
        obj = {"object": "list", "data": data, "model": model, "usage": usage}
        return await self._send_json(request, call, orjson.dumps(obj), fail)

    # ---- control API ----------------------------------------------------------------------

    async def _control(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        method = request.method
        if path == "/mock/stats" and method == "GET":
            return _json(msgspec.to_builtins(self.stats))
        if path == "/mock/requests" and method == "GET":
            entries = self.requests
            only = request.query.get("path")
            if only:
                entries = [e for e in entries if e["path"] == only]
            limit = request.query.get("limit", "")
            if limit.isdigit():
                entries = entries[len(entries) - int(limit) :] if int(limit) else []
            return _json(entries)
        if path == "/mock/config" and method in ("GET", "POST"):
            if method == "POST":
                try:
                    patch = orjson.loads(await request.read())
                    if not isinstance(patch, dict):
                        raise ValueError("the body must be a JSON object")
                    self.configure(**patch)
                except (ValueError, TypeError, msgspec.ValidationError) as exc:
                    return self._err(400, str(exc))
            return _json(msgspec.to_builtins(self.behavior))
        if path == "/mock/reset" and method == "POST":
            self.reset()
            return _json({"ok": True})
        if path == "/mock/crash" and method == "POST":
            raw = await request.read()
            try:
                spec = orjson.loads(raw) if raw else {}
            except orjson.JSONDecodeError:
                spec = None
            for_s = spec.get("for_s", 1.0) if isinstance(spec, dict) else None
            if not isinstance(for_s, int | float) or for_s < 0:
                return self._err(400, "for_s must be a number of seconds >= 0")
            if self._crash_task is None or self._crash_task.done():
                self._crash_task = asyncio.create_task(self._crash_for(float(for_s)))
            return _json({"down_for_s": for_s})
        return self._err(404, f"no control route {method} {path}", "not_found")

    async def _crash_for(self, seconds: float) -> None:
        await asyncio.sleep(0.05)  # let the answer to /mock/crash leave first
        await self.set_down(True)
        await asyncio.sleep(seconds)
        await self.set_down(False)


async def _tokens(seq: Sequence, n: int) -> None:
    """Waits until the engine produced `n` tokens of `seq` (raises ConnectionResetError if the
    engine stopped first: the server is going away)."""
    while seq.produced < n:
        if seq.finished:
            raise ConnectionResetError("the mock engine stopped")
        seq.changed.clear()
        await seq.changed.wait()


async def _forever() -> None:
    """Wait until cancelled (the client goes away, or the server stops)."""
    await asyncio.get_running_loop().create_future()


def _token_ids(prompt: bytes, n: int, seed: int | None) -> list[int]:
    """`n` word indices, a function of the prompt and the seed alone."""
    x = zlib.crc32(prompt) ^ ((seed or 0) & 0xFFFFFFFF)
    size = len(_WORDS)
    out = [x % size]
    for _ in range(n - 1):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF  # a plain LCG: cheap and stable
        out.append((x >> 8) % size)
    return out


def _chunk_head(rid: str, kind: str, model: str) -> bytes:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return b"".join(
        (
            b'{"id":"',
            rid.encode(),
            b'","object":"',
            obj.encode(),
            b'","created":',
            str(int(time.time())).encode(),
            b',"model":',
            orjson.dumps(model),
            b',"choices":[',
        )
    )


def _completion(
    rid: str, kind: str, model: str, words: list[int], finish: str, usage: dict[str, int]
) -> bytes:
    text = _WORDS[words[0]] + "".join([_WORDS_SP[w] for w in words[1:]])
    if kind == "chat":
        msg = {"role": "assistant", "content": text}
        choice: dict[str, Any] = {"index": 0, "message": msg}
    else:
        choice = {"index": 0, "text": text}
    choice["logprobs"] = None
    choice["finish_reason"] = finish
    obj = "chat.completion" if kind == "chat" else "text_completion"
    created = int(time.time())
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    out["usage"] = usage
    return orjson.dumps(out)


# ---- command line ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `gateway mock`."""
    d = MockBehavior()
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    a("--port", type=int, required=True, help="port to listen on")
    a("--tls-cert", default=None, help="serve HTTPS with this PEM certificate chain")
    a("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    a("--model", default=d.model, help="model name served by /v1/models (default %(default)s)")
    a("--latency-ms", type=float, default=d.latency_ms, help="mean delay before the first byte")
    a("--latency-dist", choices=LATENCY_DISTS, default=d.latency_dist, help="delay distribution")
    a("--tokens-per-s", type=float, default=d.tokens_per_s, help="generation pace; 0 = unpaced")
    a("--tokens", type=int, default=d.default_tokens, help="completion length without max_tokens")
    a("--fail-rate", type=float, default=d.fail_rate, help="probability a request fails")
    a("--fail-every", type=int, default=d.fail_every, help="also fail every N-th request")
    a("--fail-mode", choices=FAIL_MODES, default=d.fail_mode, help="how a failure looks")
    a("--fail-status", type=int, default=d.fail_status, help="HTTP status of `status` failures")
    a("--retry-after-s", type=float, default=None, help="Retry-After on `status` failures")
    a("--max-concurrency", type=int, default=0, help="answer 429 beyond this; 0 = unlimited")
    a(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="generations running at once, like vLLM's; the rest wait; 0 = unlimited",
    )
    a(
        "--prefix-cache",
        type=int,
        default=d.prefix_cache,
        metavar="N",
        help="keep an LRU of N prompt prefixes (vLLM prefix caching); 0 = off",
    )
    a(
        "--prefix-chars",
        type=int,
        default=d.prefix_chars,
        metavar="K",
        help="characters of the rendered prompt a prefix covers (default %(default)s)",
    )
    a(
        "--prefill-us-per-char",
        type=float,
        default=d.prefill_us_per_char,
        help="prefill time per uncached prompt character, in microseconds "
        "(e.g. 40: a 2500-character miss costs 100 ms before the first token)",
    )
    e = parser.add_argument_group(
        "engine model",
        "a continuous-batching engine (vLLM V1-like step loop: decodes first, prefill chunks, "
        "KV blocks, preemption, prefix cache); --latency-ms, --tokens-per-s and the prefix "
        "flags do not apply to it, --max-num-seqs overrides the profile's",
    )
    e.add_argument(
        "--engine",
        choices=ENGINE_PROFILES,
        default=None,
        help="run generations through the engine model with this profile's constants",
    )
    e.add_argument("--kv-tokens", type=int, default=0, help="KV cache size in tokens (0: profile)")
    e.add_argument(
        "--max-num-batched-tokens", type=int, default=0, help="tokens per step (0: profile)"
    )
    e.add_argument(
        "--speed",
        type=float,
        default=d.speed,
        help="this instance's speed: 3 = three times faster, 0.5 = twice as slow "
        "(default %(default)s)",
    )
    e.add_argument(
        "--time-factor",
        type=float,
        default=d.time_factor,
        help="multiplies every step's time (drift; POST /mock/config changes it at runtime)",
    )
    e.add_argument(
        "--knee",
        type=int,
        default=d.knee,
        metavar="N",
        help="past N running sequences each one more adds --knee-ms to every step",
    )
    e.add_argument("--knee-ms", type=float, default=d.knee_ms, help="see --knee")
    e.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="the engine's waiting-queue bound; beyond it 503 (default %(default)s)",
    )
    a("--seed", type=int, default=None, help="seed for failure/latency draws and text")


def behavior_from_args(args: argparse.Namespace) -> MockBehavior:
    """The `MockBehavior` the flags describe (raises ValueError on a bad value)."""
    return MockBehavior(
        model=args.model,
        latency_ms=args.latency_ms,
        latency_dist=args.latency_dist,
        tokens_per_s=args.tokens_per_s,
        default_tokens=args.tokens,
        fail_rate=args.fail_rate,
        fail_every=args.fail_every,
        fail_mode=args.fail_mode,
        fail_status=args.fail_status,
        retry_after_s=args.retry_after_s,
        max_concurrency=args.max_concurrency,
        max_num_seqs=args.max_num_seqs,
        prefix_cache=args.prefix_cache,
        prefix_chars=args.prefix_chars,
        prefill_us_per_char=args.prefill_us_per_char,
        engine=args.engine or "",
        kv_tokens=args.kv_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speed=args.speed,
        time_factor=args.time_factor,
        knee=args.knee,
        knee_ms=args.knee_ms,
        max_waiting=args.max_waiting,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit status."""
    try:
        behavior = behavior_from_args(args)
    except ValueError as exc:
        print(f"gateway mock: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopped.set)
        ctx = None
        if args.tls_cert:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(args.tls_cert, args.tls_key)
        async with MockServer(behavior, host=args.host, port=args.port, ssl_context=ctx) as mock:
            print(f"mock listening on {mock.url}", flush=True)
            await stopped.wait()

    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main())
        else:
            uvloop.run(main())
    except OSError as exc:  # typically the port is taken
        print(f"gateway mock: {exc}", file=sys.stderr)
        return 1
    return 0


class _EchoingRequest(web.BaseRequest):
    """A request whose answer echoes its `X-Request-Id`, as vLLM does with request-id headers
    (the gateway checks the echo: SPEC §16)."""

    async def _prepare_hook(self, response: web.StreamResponse) -> None:
        rid = self.headers.get("X-Request-Id")
        if rid is not None and "X-Request-Id" not in response.headers:
            response.headers["X-Request-Id"] = rid


def _echoing(
    message: Any, payload: Any, protocol: Any, writer: Any, task: asyncio.Task[None]
) -> web.BaseRequest:
    return _EchoingRequest(message, payload, protocol, writer, task, protocol._loop)
