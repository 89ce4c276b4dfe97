"""SPEC §15 "Backend load": what a vLLM instance says of its own load, read off the request path.

Each probe interval the prober reads `GET /metrics` (from the instance's server root) of every
`provider: vllm` instance and hands two gauges to the core:

- `vllm:num_requests_waiting` — requests the engine has queued beyond its running batch
  (`max_num_seqs`, or KV-cache room). Other clients' requests land here too, so it is load
  the gateway's own in-flight count cannot see. Summed over the lines (one per engine or
  data-parallel rank).
- `vllm:gpu_cache_usage_perc` (renamed `vllm:kv_cache_usage_perc` in newer vLLM; both are
  read) — KV-cache usage as a fraction in [0, 1] despite the name; the highest line.

And, for prefix affinity, the size of its KV cache: `vllm:cache_config_info` (an info gauge
whose labels are the engine's cache config) — `num_gpu_blocks × block_size` tokens, SPEC §15's
"bounded by that instance's cache size".

The balancers then compare `(in_flight + waiting) / max_concurrency`, equal values told apart by
the lower cache usage (rust/core/src/balancer.rs); `affinity` counts `in_flight + waiting`
against its bound. A failed or unparsable read clears the instance's backend load (a stale
queue must not keep steering traffic away), and `/admin/state` shows `backend: null`.

Cheap by construction: the body is bounded (`METRICS_MAX_BYTES`), scanned with `bytes.find`
for the two names only — no Prometheus parser, no histogram ever decoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from gateway.upstream import Upstream

__all__ = ["METRICS_MAX_BYTES", "METRICS_PATH", "BackendLoad", "parse_vllm_metrics", "read"]

METRICS_PATH: Final = "/metrics"
#: vLLM's exposition is tens of KiB (its histograms); anything past this is not read.
METRICS_MAX_BYTES: Final = 1 << 20

_WAITING: Final = b"vllm:num_requests_waiting"
_CACHE: Final = (b"vllm:gpu_cache_usage_perc", b"vllm:kv_cache_usage_perc")
_CACHE_CONFIG: Final = b"vllm:cache_config_info{"


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """One reading of an instance's own load."""

    waiting: int
    gpu_cache_usage: float
    # The KV cache's size in tokens (`vllm:cache_config_info`); None when it does not say.
    kv_tokens: int | None = None


def _values(body: bytes, name: bytes) -> list[float]:
    """The sample values of every line of metric `name` (any labels), in order."""
    out: list[float] = []
    start = 0
    while (at := body.find(name, start)) >= 0:
        start = at + len(name)
        # A sample line: the name at a line start, then labels `{...}` or a space.
        if at and body[at - 1] != 0x0A:
            continue
        end = body.find(b"\n", start)
        line = body[start : end if end >= 0 else len(body)]
        if line[:1] == b"{":
            close = line.rfind(b"}")
            if close < 0:
                continue
            line = line[close + 1 :]
        elif line[:1] not in (b" ", b"\t"):
            continue  # another metric whose name starts the same (`..._total`, `..._bucket`)
        fields = line.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out.append(value)
    return out


def parse_vllm_metrics(body: bytes) -> BackendLoad | None:
    """The two gauges from a Prometheus text body; `None` when neither is there."""
    waiting = _values(body, _WAITING)
    cache: list[float] = []
    for name in _CACHE:
        cache += _values(body, name)
    if not waiting and not cache:
        return None
    total = int(sum(max(0.0, w) for w in waiting))
    usage = min(1.0, max(0.0, max(cache, default=0.0)))
    return BackendLoad(min(total, 2**32 - 1), usage, _kv_tokens(body))


def _label(labels: bytes, name: bytes) -> int | None:
    """The integer value of label `name` in a `{a="1",b="2"}` label set, if there."""
    at = labels.find(b"," + name + b'="')
    if at < 0 and labels.startswith(b"{" + name + b'="'):
        at = 0
    if at < 0:
        return None
    start = labels.find(b'"', at) + 1
    end = labels.find(b'"', start)
    try:
        return int(labels[start:end])
    except ValueError:
        return None


def _kv_tokens(body: bytes) -> int | None:
    """`num_gpu_blocks × block_size` from `vllm:cache_config_info` (the first line)."""
    at = body.find(_CACHE_CONFIG)
    if at < 0 or (at and body[at - 1] != 0x0A):
        return None
    start = at + len(_CACHE_CONFIG) - 1
    labels = body[start : body.find(b"}", start) + 1]
    blocks, size = _label(labels, b"num_gpu_blocks"), _label(labels, b"block_size")
    if not blocks or not size or blocks < 0 or size < 0:
        return None
    return min(blocks * size, 2**40)


async def read(upstream: Upstream, timeout_s: float) -> BackendLoad | None:
    """One reading of `upstream`'s `/metrics`; `None` when it cannot be had."""
    body = await upstream.fetch(METRICS_PATH, METRICS_MAX_BYTES, timeout_s)
    return None if body is None else parse_vllm_metrics(body)
