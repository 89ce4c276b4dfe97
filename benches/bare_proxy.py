"""The ceiling for this design: a bare aiohttp + uvloop pass-through proxy.

No parsing, no scheduling, no health, no metrics: read the body, POST it to the one upstream
over a keep-alive pool, return the bytes. The gateway is measured as a ratio to this.

    python benches/bare_proxy.py --port 8090 --upstream http://127.0.0.1:9001 [--reuse-port]

With `--reuse-port` several of them share one port (SO_REUSEPORT, the kernel spreads the
connections), as `gateway serve --workers N` does: benches/workers.py compares the two.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import uvloop
from aiohttp import web


async def main(port: int, upstream: str, reuse_port: bool = False) -> None:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        async with session.post(
            upstream + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.content_type == "text/event-stream":
                out = web.StreamResponse(status=resp.status)
                out.content_type = "text/event-stream"
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            return web.Response(
                status=resp.status, body=await resp.read(), content_type=resp.content_type
            )

    server = web.Server(handle, access_log=None)
    runner = web.ServerRunner(server)
    await runner.setup()
    await web.TCPSite(
        runner, "127.0.0.1", port, backlog=4096, reuse_port=reuse_port or None
    ).start()
    print(f"bare proxy on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="upstream origin, e.g. http://127.0.0.1:9001")
    ap.add_argument(
        "--reuse-port", action="store_true", help="SO_REUSEPORT: several processes, one port"
    )
    args = ap.parse_args()
    uvloop.run(main(args.port, args.upstream, args.reuse_port))
