"""The Batch API's HTTP routes: OpenAI's `/v1/files` and `/v1/batches`, shapes and statuses.

SPEC §14: "`POST /v1/files` (multipart, `purpose=batch`, JSONL), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`; `POST /v1/batches`
(`input_file_id`, `endpoint`, `completion_window: "24h"`, `metadata`), `GET /v1/batches/{id}`,
`GET /v1/batches` (`after`, `limit`), `POST /v1/batches/{id}/cancel`. Shapes and statuses ...
as in OpenAI's OpenAPI description" — `OpenAIFile`, `DeleteFileResponse`, `ListFilesResponse`,
`Batch`, `ListBatchesResponse`, so the official client's `files.*` and `batches.*` work as
they are. Errors are the gateway's OpenAI-shaped ones (`gateway.errors`).

Ownership (SPEC §14 "Keys own their files and batches (another key gets 404)"): every lookup
is scoped to the caller's owner (`owners.principal`); the admin key sees all. An upload is
bounded by `batch.max_file_bytes` (413, checked on `Content-Length` before reading, then while
streaming to disk) and only `purpose=batch` is accepted (the gateway runs batches; it is not a
general file store).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import msgspec
import orjson
from aiohttp import BodyPartReader, web

from gateway.batch import owners
from gateway.batch.store import BatchRow, FileRow, Store, fsync_dir, new_id, now_s
from gateway.errors import InvalidRequest, MethodNotAllowed, NotFound, RequestTooLarge
from gateway.messages import ENDPOINTS

if TYPE_CHECKING:
    from gateway.batch.service import BatchService

__all__ = ["COMPLETION_WINDOW_S", "BatchApi", "batch_doc", "file_doc"]

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]

#: OpenAI's only completion window, "24h": a batch still running then ends `expired`.
COMPLETION_WINDOW_S: int = 24 * 3600
_JSON: Final = "application/json"
_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,100}")
_MULTIPART_SLACK: Final = 64 * 1024  # headers and boundaries around the file's bytes
_FIELD_MAX: Final = 1024  # a form field other than `file`
_BODY_MAX: Final = 1 << 20  # a POST /v1/batches body
_WRITE_CHUNK: Final = 1 << 20
_METADATA_PAIRS: Final = 16


class _CreateBatch(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: Any = None  # accepted; outputs are kept until deleted


def file_doc(f: FileRow) -> dict[str, Any]:
    """OpenAI's `OpenAIFile`."""
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "expires_at": None,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_doc(b: BatchRow) -> dict[str, Any]:
    """OpenAI's `Batch`."""
    errors = orjson.loads(b.errors) if b.errors else None
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "model": b.model,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": b.created_at,
        "in_progress_at": b.in_progress_at,
        "expires_at": b.expires_at,
        "finalizing_at": b.finalizing_at,
        "completed_at": b.completed_at,
        "failed_at": b.failed_at,
        "expired_at": b.expired_at,
        "cancelling_at": b.cancelling_at,
        "cancelled_at": b.cancelled_at,
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": orjson.loads(b.metadata) if b.metadata else None,
        "usage": {
            "input_tokens": b.input_tokens,
            "input_tokens_details": {"cached_tokens": b.cached_tokens},
            "output_tokens": b.output_tokens,
            "output_tokens_details": {"reasoning_tokens": b.reasoning_tokens},
            "total_tokens": b.total_tokens,
        },
    }


def _json(doc: Any) -> web.Response:
    return web.Response(body=orjson.dumps(doc), content_type=_JSON)


def _page(docs: list[dict[str, Any]], more: bool) -> web.Response:
    return _json(
        {
            "object": "list",
            "data": docs,
            "first_id": docs[0]["id"] if docs else None,
            "last_id": docs[-1]["id"] if docs else None,
            "has_more": more,
        }
    )


def _int_param(request: web.BaseRequest, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be an integer from {lo} to {hi}.", param=name)
    return value


def _cursor(request: web.BaseRequest) -> str | None:
    after = request.query.get("after")
    if after is None or after == "":
        return None
    if not _ID.fullmatch(after):
        raise InvalidRequest("'after' must be an id from a previous page.", param="after")
    return after


class BatchApi:
    """The routes, over one `BatchService`."""

    def __init__(self, service: BatchService) -> None:
        self.service = service

    def routes(self) -> dict[tuple[str, str], Handler]:
        """The exact paths (the ids in the others are matched by `route`)."""
        return {
            ("POST", "/v1/files"): self.create_file,
            ("GET", "/v1/files"): self.list_files,
            ("POST", "/v1/batches"): self.create_batch,
            ("GET", "/v1/batches"): self.list_batches,
        }

    def route(self, method: str, path: str) -> Handler | None:
        """`/v1/files/{id}[/content]`, `/v1/batches/{id}[/cancel]`: the handler, one that
        answers 405 for another method, or None (no such route)."""
        parts = path.split("/")
        if len(parts) not in (4, 5) or parts[1] != "v1" or not parts[3]:
            return None
        kind, oid = parts[2], parts[3]
        sub = parts[4] if len(parts) == 5 else None
        table: dict[str, Callable[[web.BaseRequest, str], Awaitable[web.StreamResponse]]]
        if kind == "files" and sub is None:
            table = {"GET": self.retrieve_file, "DELETE": self.delete_file}
        elif kind == "files" and sub == "content":
            table = {"GET": self.file_content}
        elif kind == "batches" and sub is None:
            table = {"GET": self.retrieve_batch}
        elif kind == "batches" and sub == "cancel":
            table = {"POST": self.cancel_batch}
        else:
            return None
        found = table.get(method)
        if found is None:
            allowed = ", ".join(table)
            wrong = MethodNotAllowed(f"Use {allowed} on this route.", headers={"Allow": allowed})

            async def refuse(request: web.BaseRequest) -> web.StreamResponse:
                raise wrong

            return refuse

        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            return await found(request, oid)

        return handler

    async def _open(self, request: web.BaseRequest) -> tuple[owners.Principal, Store | None]:
        """The caller, and the store if it exists (reads do not create it)."""
        who = owners.principal(self.service.gw.keys, request.headers)
        return who, await self.service.existing()

    # ---- files -----------------------------------------------------------------------------

    async def create_file(self, request: web.BaseRequest) -> web.StreamResponse:
        who = owners.principal(self.service.gw.keys, request.headers)
        mime = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if mime != "multipart/form-data":
            raise InvalidRequest(
                "Upload the file as multipart/form-data with the fields 'file' and 'purpose'."
            )
        limit = self.service.gw.runtime.config.batch.max_file_bytes
        if request.content_length is not None and request.content_length > limit + _MULTIPART_SLACK:
            raise _too_large(limit)
        upload = _Upload(await self.service.open(), limit)
        try:
            purpose = await upload.read(request)
            return _json(file_doc(await upload.commit(who.owner, purpose)))
        finally:
            await upload.discard()

    async def list_files(self, request: web.BaseRequest) -> web.StreamResponse:
        limit = _int_param(request, "limit", 10_000, 1, 10_000)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
        purpose = request.query.get("purpose") or None
        after = _cursor(request)
        who, store = await self._open(request)
        if store is None:
            return _page([], False)
        rows, more = await store.call(
            store.db.list_files, who.sees, purpose, after, limit, order == "desc"
        )
        return _page([file_doc(f) for f in rows], more)

    async def _file(self, request: web.BaseRequest, file_id: str) -> tuple[Store, FileRow]:
        who, store = await self._open(request)
        found = None
        if store is not None and _ID.fullmatch(file_id):
            found = await store.call(store.db.get_file, file_id, who.sees)
        if store is None or found is None:
            raise NotFound("No such file.", param="file_id")
        return store, found

    async def retrieve_file(self, request: web.BaseRequest, file_id: str) -> web.StreamResponse:
        _, found = await self._file(request, file_id)
        return _json(file_doc(found))

    async def file_content(self, request: web.BaseRequest, file_id: str) -> web.StreamResponse:
        store, found = await self._file(request, file_id)
        path = store.file_path(found.id)
        if not await asyncio.to_thread(path.is_file):
            raise NotFound("The file's content is gone from the store.", param="file_id")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def delete_file(self, request: web.BaseRequest, file_id: str) -> web.StreamResponse:
        store, found = await self._file(request, file_id)
        await store.call(store.db.delete_file, found.id, None)
        return _json({"id": found.id, "object": "file", "deleted": True})

    # ---- batches ---------------------------------------------------------------------------

    async def create_batch(self, request: web.BaseRequest) -> web.StreamResponse:
        who = owners.principal(self.service.gw.keys, request.headers)
        spec = _decode_create(await _read_json(request))
        store = await self.service.existing()
        source = None
        if store is not None and _ID.fullmatch(spec.input_file_id):
            source = await store.call(store.db.get_file, spec.input_file_id, who.sees)
        if store is None or source is None:
            raise NotFound("No such file.", param="input_file_id")
        if source.purpose != "batch":
            message = "The input file must have been uploaded with purpose 'batch'."
            raise InvalidRequest(message, param="input_file_id")
        now = now_s()
        metadata = orjson.dumps(spec.metadata).decode() if spec.metadata else None
        row = BatchRow.new(
            new_id("batch_"), who.owner, spec.endpoint, source.id, now,
            now + COMPLETION_WINDOW_S, metadata,
        )  # fmt: skip
        row = await store.call(store.db.create_batch, row)
        self.service.submit(row)
        return _json(batch_doc(row))

    async def _batch(self, request: web.BaseRequest, batch_id: str) -> tuple[Store, BatchRow]:
        who, store = await self._open(request)
        found = None
        if store is not None and _ID.fullmatch(batch_id):
            found = await store.call(store.db.get_batch, batch_id, who.sees)
        if store is None or found is None:
            raise NotFound("No such batch.", param="batch_id")
        return store, found

    async def retrieve_batch(self, request: web.BaseRequest, batch_id: str) -> web.StreamResponse:
        _, found = await self._batch(request, batch_id)
        return _json(batch_doc(found))

    async def list_batches(self, request: web.BaseRequest) -> web.StreamResponse:
        limit = _int_param(request, "limit", 20, 1, 100)
        after = _cursor(request)
        who, store = await self._open(request)
        if store is None:
            return _page([], False)
        rows, more = await store.call(store.db.list_batches, who.sees, after, limit)
        return _page([batch_doc(b) for b in rows], more)

    async def cancel_batch(self, request: web.BaseRequest, batch_id: str) -> web.StreamResponse:
        store, found = await self._batch(request, batch_id)
        old, row = await store.call(store.db.cancel, found.seq, now_s())
        if row.status == "cancelling" and old != "cancelling":
            self.service.transition(old, "cancelling")
            if self.service.runner is not None:
                self.service.runner.cancel(row.seq)
        elif row.status not in ("cancelling", "cancelled"):
            raise InvalidRequest(
                f"Only a validating or in-progress batch can be cancelled; this one is "
                f"{row.status}.",
                param="batch_id",
            )
        return _json(batch_doc(row))


# ---- request bodies --------------------------------------------------------------------------


async def _read_json(request: web.BaseRequest) -> bytes:
    mime = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if mime != _JSON and not mime.endswith("+json"):
        raise InvalidRequest(f"Content-Type must be application/json, not {mime or 'missing'!r}.")
    if request.content_length is not None and request.content_length > _BODY_MAX:
        raise RequestTooLarge(f"The request body exceeds {_BODY_MAX} bytes.")
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > _BODY_MAX:
            raise RequestTooLarge(f"The request body exceeds {_BODY_MAX} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode_create(raw: bytes) -> _CreateBatch:
    try:
        spec = msgspec.json.decode(raw, type=_CreateBatch)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - at `$.")
        param = where.rstrip("`") or None
        raise InvalidRequest(f"Invalid request: {message}", param=param) from None
    except msgspec.DecodeError:
        raise InvalidRequest("The request body is not valid JSON.") from None
    if spec.endpoint not in ENDPOINTS:
        served = ", ".join(ENDPOINTS)
        raise InvalidRequest(f"This gateway runs batches for {served} only.", param="endpoint")
    if spec.completion_window != "24h":
        raise InvalidRequest("'completion_window' must be \"24h\".", param="completion_window")
    _check_metadata(spec.metadata)
    return spec


def _check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's `Metadata`: at most 16 pairs, keys ≤ 64 and values ≤ 512 characters."""
    if metadata is None:
        return
    if len(metadata) > _METADATA_PAIRS:
        raise InvalidRequest("'metadata' holds at most 16 pairs.", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise InvalidRequest(
                "'metadata' keys are at most 64 and values at most 512 characters.",
                param="metadata",
            )


def _too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The file exceeds {limit} bytes (batch.max_file_bytes).")


class _Upload:
    """One multipart upload, streamed to a temp file beside the store's files."""

    def __init__(self, store: Store, limit: int) -> None:
        self.store = store
        self.limit = limit
        self.tmp: Path | None = None
        self.size = 0
        self.filename = "upload.jsonl"

    async def read(self, request: web.BaseRequest) -> str | None:
        """Reads every part; returns `purpose` (the file is staged in `self.tmp`)."""
        purpose: str | None = None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidRequest("Nested multipart bodies are not accepted.")
            if part.name == "file" and self.tmp is None:
                await self._stage(part)
            elif part.name == "purpose":
                purpose = (await _small(part)).decode("utf-8", "replace").strip()
            else:
                await _small(part)  # `expires_after[...]` and the like: read, ignored
        return purpose

    async def _stage(self, part: BodyPartReader) -> None:
        self.filename = _clean_name(part.filename)
        self.tmp = self.store.files_dir / f".upload-{new_id('')}.tmp"
        f: IO[bytes] = await asyncio.to_thread(open, self.tmp, "wb")
        try:
            pending = bytearray()
            while chunk := await part.read_chunk(256 * 1024):
                self.size += len(chunk)
                if self.size > self.limit:
                    raise _too_large(self.limit)
                pending += chunk
                if len(pending) >= _WRITE_CHUNK:
                    await asyncio.to_thread(f.write, bytes(pending))
                    pending.clear()
            await asyncio.to_thread(_finish, f, bytes(pending))
        finally:
            await asyncio.to_thread(f.close)

    async def commit(self, owner: str, purpose: str | None) -> FileRow:
        if self.tmp is None:
            raise InvalidRequest("Missing the 'file' part.", param="file")
        if purpose is None:
            raise InvalidRequest("Missing the 'purpose' field.", param="purpose")
        if purpose != "batch":
            raise InvalidRequest(
                "This gateway accepts files of purpose 'batch' only.", param="purpose"
            )
        row = FileRow(0, new_id("file-"), owner, "batch", self.filename, self.size, now_s())
        await asyncio.to_thread(_move, self.tmp, self.store.file_path(row.id))
        self.tmp = None
        return await self.store.call(self.store.db.add_file, row)

    async def discard(self) -> None:
        if self.tmp is not None:
            await asyncio.to_thread(self.tmp.unlink, True)
            self.tmp = None


def _move(src: Path, dest: Path) -> None:
    os.replace(src, dest)
    fsync_dir(dest.parent)


def _finish(f: IO[bytes], tail: bytes) -> None:
    f.write(tail)
    f.flush()
    os.fsync(f.fileno())


async def _small(part: BodyPartReader) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(_FIELD_MAX):
        data += chunk
        if len(data) > _FIELD_MAX:
            raise InvalidRequest(f"A form field other than 'file' exceeds {_FIELD_MAX} bytes.")
    return bytes(data)


def _clean_name(name: str | None) -> str:
    """The uploaded file's name as shown back: its last path part, printable, bounded."""
    base = os.path.basename((name or "").replace("\\", "/"))
    base = "".join(c for c in base if c.isprintable())[:255]
    return base or "upload.jsonl"
