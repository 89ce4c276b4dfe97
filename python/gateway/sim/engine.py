"""A continuous-batching engine model for `gateway mock --engine` (after vLLM V1's scheduler).

One step loop per mock instance. Every step:

1. **decodes first**: each running sequence past its prefill generates one token;
2. **then prefill chunks**, in admission order, within `max_num_batched_tokens` per step;
3. **admission** from the waiting queue (FIFO) while fewer than `max_num_seqs` run, the
   step's token budget is not spent and the prompt's KV blocks (16 tokens each) are free —
   otherwise the request waits inside the engine (`vllm:num_requests_waiting`);
4. **preemption**: when a decode needs a block and none is free, the newest running sequence
   is preempted (its blocks freed, put back at the head of the queue) and later recomputed:
   its prompt and the tokens it already produced are prefilled again.

A step takes `t0 + a_p·prefilled + a_d·decodes + a_kv·Σcontext` (±5 % jitter from a seeded
generator), divided by the instance's `speed` and multiplied by its `time_factor` (drift, a
runtime knob); past `knee` running sequences each one more adds `knee_ms` (a backend past its
knee). The **prefix cache** is an LRU of chained block hashes (a block's hash covers the whole
prompt up to its end, like vLLM's): a prompt's leading cached blocks skip their prefill.

A token is `CHARS_PER_TOKEN` prompt characters (the mock's usage counts the same way). The
model is pure Python on the event loop: good for the shapes (TTFT after prefill, time per
token growing with the batch, waiting beyond KV capacity), not for microsecond accuracy.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from dataclasses import dataclass, field, replace
from typing import Final

__all__ = [
    "BLOCK_TOKENS",
    "CHARS_PER_TOKEN",
    "PROFILES",
    "Engine",
    "EngineFull",
    "Profile",
    "Sequence",
    "block_hashes",
    "profile_with",
]

BLOCK_TOKENS: Final = 16  # vLLM's default KV block size
CHARS_PER_TOKEN: Final = 4  # the mock's usage rule of thumb (≈ chars/4)
JITTER: Final = 0.05  # ±5 % per step


@dataclass(frozen=True, slots=True)
class Profile:
    """An engine's constants (times in milliseconds)."""

    t0_ms: float  # a step's fixed cost (weights read from HBM once per step)
    prefill_ms: float  # a_p: per uncached prompt token prefilled
    decode_ms: float  # a_d: per sequence decoding in the step
    kv_ms: float  # a_kv: per context token of the running sequences (KV reads)
    kv_tokens: int  # KV cache capacity
    max_num_seqs: int
    max_num_batched_tokens: int


# Design §5's table: Llama-class 7-8B models; h100-7b is the default.
PROFILES: Final[dict[str, Profile]] = {
    "h100-7b": Profile(6.0, 0.035, 0.03, 0.04e-3, 400_000, 1024, 8192),
    "a100-7b": Profile(10.0, 0.08, 0.08, 0.065e-3, 400_000, 256, 2048),
}


class EngineFull(Exception):
    """The engine's waiting queue is at its bound (answered 503)."""


def block_hashes(prompt: str) -> list[int]:
    """Chained hashes of the prompt's full blocks (each covers everything before it)."""
    size = BLOCK_TOKENS * CHARS_PER_TOKEN
    out: list[int] = []
    h = 0
    for k in range(0, len(prompt) - size + 1, size):
        h = hash((h, prompt[k : k + size]))
        out.append(h)
    return out


@dataclass(slots=True, eq=False)
class Sequence:
    """One request inside the engine."""

    prompt_tokens: int
    max_tokens: int
    hashes: list[int]
    # progress
    computed: int = 0  # context tokens whose KV exists (prefill and decodes so far)
    target: int = 0  # context to prefill before decoding (prompt, + output after preemption)
    produced: int = 0  # output tokens generated (never taken back: streamed already)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    blocks: int = 0  # KV blocks held
    preemptions: int = 0
    finished: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def context(self) -> int:
        return self.computed

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target


def _blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


class Engine:
    """The step loop of one instance. `submit()` then wait on the sequence's `changed` event
    (set after every step that produced a token for it, and when it finishes)."""

    def __init__(
        self,
        profile: Profile,
        *,
        speed: float = 1.0,
        time_factor: float = 1.0,
        knee: int = 0,
        knee_ms: float = 0.0,
        max_waiting: int = 1024,
        seed: int | None = None,
    ) -> None:
        self.profile = profile
        self.speed = speed
        self.time_factor = time_factor
        self.knee = knee
        self.knee_ms = knee_ms
        self.max_waiting = max_waiting
        self._rng = random.Random(seed)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.used_blocks = 0
        # prefix cache: block hash -> None, least recently used first
        self._cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # counters (vLLM's names on /metrics)
        self.steps = 0
        self.preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which cached
        self.last_step_ms = 0.0

    # ---- knobs ------------------------------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        return max(1, self.profile.kv_tokens // BLOCK_TOKENS)

    def reconfigure(
        self,
        profile: Profile,
        *,
        speed: float,
        time_factor: float,
        knee: int,
        knee_ms: float,
        max_waiting: int,
    ) -> None:
        """New constants from a `/mock/config` patch (drift at runtime: `time_factor`)."""
        self.profile, self.speed, self.time_factor = profile, speed, time_factor
        self.knee, self.knee_ms, self.max_waiting = knee, knee_ms, max_waiting
        while len(self._cache) > self.total_blocks:
            self._cache.popitem(last=False)

    def usage(self) -> float:
        """KV-cache usage, 0..1 (blocks held by running sequences)."""
        return min(1.0, self.used_blocks / self.total_blocks)

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, prompt: str, prompt_tokens: int, max_tokens: int) -> Sequence:
        """Queues a request; raises `EngineFull` beyond `max_waiting` waiting and ValueError
        when the prompt and `max_tokens` together exceed the whole KV cache."""
        if len(self.waiting) >= self.max_waiting:
            raise EngineFull
        if _blocks_for(max(1, prompt_tokens) + max(1, max_tokens)) > self.total_blocks:
            # it could never run to its end alone (vLLM refuses prompt + max_tokens beyond
            # its context length)
            raise ValueError("prompt and max_tokens exceed the KV cache")
        seq = Sequence(max(1, prompt_tokens), max(1, max_tokens), block_hashes(prompt))
        seq.target = seq.prompt_tokens
        self.waiting.append(seq)
        self._ensure_loop()
        self._wake.set()
        return seq

    def abandon(self, seq: Sequence) -> None:
        """The client went away: free what the sequence holds."""
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.used_blocks -= seq.blocks
            seq.blocks = 0
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(seq)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for seq in [*self.running, *self.waiting]:
            seq.finished = True
            seq.changed.set()
        self.running.clear()
        self.waiting.clear()
        self.used_blocks = 0

    # ---- the step loop ----------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = self.schedule()
            if plan is None:  # nothing fits (cannot happen with a sane KV size): wait
                self._wake.clear()
                await self._wake.wait()
                continue
            ms = self.step_ms(*plan[1:])
            self.last_step_ms = ms
            await asyncio.sleep(ms / 1000.0)
            self.apply(plan[0])

    def schedule(self) -> tuple[list[tuple[Sequence, int]], int, int, int] | None:
        """The next step's work: (sequence, tokens) per sequence, prefilled tokens, decodes,
        Σcontext. Decodes first, then prefill chunks, then admission; preempts when a decode
        finds no free block."""
        p = self.profile
        budget = p.max_num_batched_tokens
        work: list[tuple[Sequence, int]] = []
        # 1. decodes (each needs room for one more token)
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.prefilling:
                i += 1
                continue
            if budget <= 0:
                break
            need = _blocks_for(seq.computed + 1) - seq.blocks
            while need > 0 and self.used_blocks + need > self.total_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue  # it was the newest, preempted itself: the loop index stays
            if need > 0:
                seq.blocks += need
                self.used_blocks += need
            work.append((seq, 1))
            budget -= 1
            i += 1
        decodes = len(work)
        prefilled = 0
        # 2. prefill chunks of admitted sequences
        for seq in self.running:
            if budget <= 0:
                break
            if seq.prefilling:
                chunk = min(seq.target - seq.computed, budget)
                work.append((seq, chunk))
                prefilled += chunk
                budget -= chunk
        # 3. admission
        while self.waiting and budget > 0 and len(self.running) < p.max_num_seqs:
            seq = self.waiting[0]
            blocks = _blocks_for(seq.target + 1)
            if self.used_blocks + blocks > self.total_blocks:
                break  # waits for blocks (vLLM: stays in the waiting queue)
            self.waiting.popleft()
            if seq.preemptions == 0 and seq.computed == 0:
                cached = self._lookup(seq)
                seq.cached_tokens = cached
                seq.computed = cached
            seq.blocks = blocks
            self.used_blocks += blocks
            self.running.append(seq)
            chunk = min(seq.target - seq.computed, budget)
            if chunk > 0:
                work.append((seq, chunk))
                prefilled += chunk
                budget -= chunk
        if not work:
            return None
        context = sum(s.computed for s in self.running)
        return work, prefilled, decodes, context

    def step_ms(self, prefilled: int, decodes: int, context: int) -> float:
        """One step's duration (design §5), with jitter, speed, drift and the knee."""
        p = self.profile
        ms = p.t0_ms + p.prefill_ms * prefilled + p.decode_ms * decodes + p.kv_ms * context
        running = len(self.running)
        if self.knee and running > self.knee:
            ms += self.knee_ms * (running - self.knee)
        ms *= self._rng.uniform(1.0 - JITTER, 1.0 + JITTER)
        return ms * self.time_factor / self.speed

    def apply(self, work: list[tuple[Sequence, int]]) -> None:
        """The step's results: context grows; a sequence whose prefill completed, or that
        decoded, emits one token; finished ones leave and free their blocks."""
        self.steps += 1
        for seq, tokens in work:
            if seq.finished or seq not in self.running:
                continue  # abandoned or preempted during the step
            was_prefilling = seq.prefilling
            seq.computed += tokens
            if was_prefilling and seq.prefilling:
                continue  # more chunks to go
            if was_prefilling and seq.produced > 0:
                continue  # recomputed after a preemption: decoding resumes next step
            seq.produced += 1
            if seq.produced >= seq.max_tokens:
                self._finish(seq)
            seq.changed.set()

    # ---- helpers ----------------------------------------------------------------------------

    def _lookup(self, seq: Sequence) -> int:
        """Cached leading prompt tokens (refreshing them in the LRU); at least one token is
        always computed (vLLM recomputes the last one to sample from)."""
        cached_blocks = 0
        for h in seq.hashes:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            cached_blocks += 1
        cached = min(cached_blocks * BLOCK_TOKENS, seq.prompt_tokens - 1)
        self.prefix_queries += seq.prompt_tokens
        self.prefix_hits += cached
        return max(0, cached)

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        self.running.remove(seq)
        self.used_blocks -= seq.blocks
        seq.blocks = 0
        # its prompt's blocks stay cached (freed blocks keep their hashes until reused)
        for h in seq.hashes:
            self._cache[h] = None
            self._cache.move_to_end(h)
        while len(self._cache) > self.total_blocks:
            self._cache.popitem(last=False)

    def _preempt(self, seq: Sequence) -> None:
        """vLLM's recompute preemption: blocks freed, back to the head of the queue, prompt
        and produced tokens prefilled again when readmitted."""
        self.running.remove(seq)
        self.used_blocks -= seq.blocks
        seq.blocks = 0
        seq.computed = 0
        seq.target = seq.prompt_tokens + seq.produced
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)


def profile_with(
    name: str, *, max_num_seqs: int = 0, kv_tokens: int = 0, max_num_batched_tokens: int = 0
) -> Profile:
    """A named profile with the given overrides (0 keeps the profile's value)."""
    p = PROFILES[name]
    return replace(
        p,
        max_num_seqs=max_num_seqs or p.max_num_seqs,
        kv_tokens=kv_tokens or p.kv_tokens,
        max_num_batched_tokens=max_num_batched_tokens or p.max_num_batched_tokens,
    )
