"""SPEC §12 × §14: with `--workers N` the Batch API has one home, worker 0 (one store, one
runner: a batch is never run twice). The other workers relay `/v1/files*` and `/v1/batches*`
to it over a private Unix socket, streaming both ways (an upload or a download is never held
whole in a relaying worker). Lines of a batch are scheduled through worker 0's pools, which
share the one scheduling state with every worker.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from gateway.errors import Restarting
from gateway.responses import error_response

__all__ = ["BatchRelay", "is_batch_path"]

_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
_CHUNK = 64 * 1024


def is_batch_path(path: str) -> bool:
    return path.startswith(("/v1/files", "/v1/batches"))


class BatchRelay:
    """Relays Batch API requests to the worker that serves them."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                auto_decompress=False,
            )
        return self._session

    async def relay(self, request: web.BaseRequest) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = request.content if request.body_exists else None
        try:
            async with self._client().request(
                request.method,
                "http://batch" + request.path_qs,
                headers=headers,
                data=body,
                allow_redirects=False,
            ) as upstream:
                resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP:
                        resp.headers.add(k, v)
                if upstream.content_length is not None:
                    resp.content_length = upstream.content_length
                await resp.prepare(request)
                async for chunk in upstream.content.iter_chunked(_CHUNK):
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
        except (aiohttp.ClientConnectionError, OSError):
            # Worker 0 is restarting (the supervisor respawns it within a second or so).
            return error_response(
                Restarting("The batch service is restarting; retry shortly.", retry_after_ms=2000)
            )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
