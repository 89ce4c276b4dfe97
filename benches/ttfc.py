"""Time to first chunk of a stream, one request at a time: what a streaming user feels.

Run by `e2e.py --ttfc` (pinned to the load generator's core): `n` sequential streaming
requests over one keep-alive connection; prints p50/p99 of the time from sending the
request to the first SSE data line. Standard library only, so its own cost is small and the
same for every target.

    python benches/ttfc.py URL [n]
"""

from __future__ import annotations

import http.client
import statistics
import sys
import time
from urllib.parse import urlsplit

BODY = (
    b'{"model":"m","messages":[{"role":"user","content":"does this compile?"}],'
    b'"max_tokens":8,"stream":true}'
)


def main() -> int:
    url = urlsplit(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80)
    samples = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        conn.request("POST", url.path, BODY, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = None
        while line := resp.readline():
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter() - t0
        resp.read()
        if i >= 20 and first is not None:  # the first 20 warm up
            samples.append(first * 1000)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    print(f"{statistics.median(samples):.3f} {p99:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
