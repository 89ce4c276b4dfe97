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

Quotas and expiry (SPEC §14): an upload counts against its key's `batch.max_stored_bytes`
(every file the key keeps, outputs included; 413 `quota_exceeded`, checked on
`Content-Length` first, then while streaming); a file honours OpenAI's `expires_after`
(`anchor: created_at`, 3,600 to 2,592,000 seconds; a batch input file without it expires after
30 days, as OpenAI's do) and a batch's `output_expires_after` its output files (else
`batch.output_ttl`); the runner's janitor deletes them. A store failure is the client's 507
or 503 (`faults`); a malformed multipart body (no boundary, a control character in a file
name) is 400 `invalid_request`.
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
from aiohttp.http_exceptions import HttpProcessingError

from gateway.batch import owners
from gateway.batch.faults import QuotaExceeded, classify
from gateway.batch.store import BatchRow, FileRow, Store, new_id, now_s
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
#: OpenAI's `expires_after.seconds` bounds (1 hour to 30 days), and a batch file's default.
EXPIRES_MIN_S: Final = 3600
EXPIRES_MAX_S: Final = 2_592_000
BATCH_FILE_TTL_S: Final = 2_592_000


class _ExpiresAfter(msgspec.Struct):
    anchor: str
    seconds: int


class _CreateBatch(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: _ExpiresAfter | None = None


def file_doc(f: FileRow) -> dict[str, Any]:
    """OpenAI's `OpenAIFile`."""
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "expires_at": f.expires_at,
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
        who = owners.principal(self.service.ports.keys(), request.headers)
        return who, await self.service.existing()

    # ---- files -----------------------------------------------------------------------------

    async def create_file(self, request: web.BaseRequest) -> web.StreamResponse:
        who = owners.principal(self.service.ports.keys(), request.headers)
        mime = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if mime != "multipart/form-data":
            raise InvalidRequest(
                "Upload the file as multipart/form-data with the fields 'file' and 'purpose'."
            )
        cfg = self.service.ports.settings.config.batch
        limit = cfg.max_file_bytes
        if request.content_length is not None and request.content_length > limit + _MULTIPART_SLACK:
            raise _too_large(limit)
        store = await self.service.open()
        # SPEC §14: "per key `batch.max_stored_bytes` (... 413/429-shaped error when exceeded)".
        room = cfg.max_stored_bytes - await store.call(store.db.used_bytes, who.owner)
        if request.content_length is not None and request.content_length > room + _MULTIPART_SLACK:
            raise _over_quota(cfg.max_stored_bytes)
        upload = _Upload(store, limit, room, cfg.max_stored_bytes)
        try:
            try:
                purpose = await upload.read(request)
                return _json(file_doc(await upload.commit(who.owner, purpose)))
            except OSError as exc:  # the staging disk: full or read-only → 507 / 503
                mapped = classify(exc)
                if mapped is None:
                    raise
                raise mapped from exc
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
        if store.files_dir is None:
            return await _stream_chunks(request, store, found)
        path = store.files_dir / found.id
        if not await asyncio.to_thread(path.is_file):
            raise NotFound("The file's content is gone from the store.", param="file_id")
        return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})

    async def delete_file(self, request: web.BaseRequest, file_id: str) -> web.StreamResponse:
        store, found = await self._file(request, file_id)
        await store.call(store.db.delete_file, found.id, None)
        return _json({"id": found.id, "object": "file", "deleted": True})

    # ---- batches ---------------------------------------------------------------------------

    async def create_batch(self, request: web.BaseRequest) -> web.StreamResponse:
        who = owners.principal(self.service.ports.keys(), request.headers)
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
        ttl = spec.output_expires_after.seconds if spec.output_expires_after else None
        row = BatchRow.new(
            new_id("batch_"), who.owner, spec.endpoint, source.id, now,
            now + COMPLETION_WINDOW_S, metadata, output_ttl=ttl,
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
    if spec.output_expires_after is not None:
        _check_expiry(spec.output_expires_after, "output_expires_after")
    return spec


def _check_expiry(spec: _ExpiresAfter, param: str) -> None:
    """OpenAI's `expires_after`: anchor `created_at`, 3,600 to 2,592,000 seconds."""
    if spec.anchor != "created_at":
        raise InvalidRequest(f"'{param}.anchor' must be \"created_at\".", param=f"{param}.anchor")
    if not EXPIRES_MIN_S <= spec.seconds <= EXPIRES_MAX_S:
        raise InvalidRequest(
            f"'{param}.seconds' must be from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}.",
            param=f"{param}.seconds",
        )


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


def _over_quota(quota: int) -> QuotaExceeded:
    return QuotaExceeded(
        f"This upload would pass your key's storage quota of {quota} bytes "
        "(batch.max_stored_bytes); delete files you no longer need."
    )


async def _stream_chunks(
    request: web.BaseRequest, store: Store, found: FileRow
) -> web.StreamResponse:
    """A file kept in the database, sent chunk by chunk (one in memory at a time)."""
    first = await store.call(store.db.read_chunk, found.id, 0)
    if first is None and found.bytes:
        raise NotFound("The file's content is gone from the store.", param="file_id")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = found.bytes
    await resp.prepare(request)
    n, chunk = 0, first
    while chunk is not None:
        await resp.write(chunk)
        n += 1
        chunk = await store.call(store.db.read_chunk, found.id, n)
    await resp.write_eof()
    return resp


class _Upload:
    """One multipart upload, streamed to a temp file in the store's staging directory."""

    def __init__(self, store: Store, limit: int, room: int, quota: int) -> None:
        self.store = store
        self.limit = limit
        self.room = room  # bytes the key may still store
        self.quota = quota
        self.tmp: Path | None = None
        self.size = 0
        self.filename = "upload.jsonl"
        self.anchor: str | None = None
        self.seconds: str | None = None

    async def read(self, request: web.BaseRequest) -> str | None:
        """Reads every part; returns `purpose` (the file is staged in `self.tmp`). A body
        that is not valid multipart is the client's error (400), never a 500."""
        try:
            return await self._read(request)
        except (
            ValueError,
            AssertionError,
            LookupError,
            UnicodeError,
            HttpProcessingError,  # a part's header aiohttp refuses (a control character)
        ) as exc:
            raise InvalidRequest(
                "The body is not valid multipart/form-data (a boundary in Content-Type, then "
                "the fields 'file' and 'purpose')."
            ) from exc

    async def _read(self, request: web.BaseRequest) -> str | None:
        purpose: str | None = None
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                raise InvalidRequest("Nested multipart bodies are not accepted.")
            if part.name == "file" and self.tmp is None:
                await self._stage(part)
            elif part.name == "purpose":
                purpose = (await _small(part)).decode("utf-8", "replace").strip()
            elif part.name == "expires_after[anchor]":
                self.anchor = (await _small(part)).decode("utf-8", "replace").strip()
            elif part.name == "expires_after[seconds]":
                self.seconds = (await _small(part)).decode("utf-8", "replace").strip()
            else:
                await _small(part)  # other fields: read, ignored
        return purpose

    def expires_at(self, created_at: int) -> int:
        """OpenAI's `expires_after`: the file's `expires_at`; a batch file's default is 30
        days (SPEC §14 "files honour OpenAI's `expires_after`")."""
        if self.anchor is None and self.seconds is None:
            return created_at + BATCH_FILE_TTL_S
        try:
            seconds = int(self.seconds or "")
        except ValueError:
            seconds = -1
        _check_expiry(_ExpiresAfter(self.anchor or "", seconds), "expires_after")
        return created_at + seconds

    async def _stage(self, part: BodyPartReader) -> None:
        self.filename = _clean_name(part.filename)
        self.tmp = self.store.staging_dir / f".upload-{new_id('')}.tmp"
        f: IO[bytes] = await asyncio.to_thread(open, self.tmp, "wb")
        try:
            pending = bytearray()
            while chunk := await part.read_chunk(256 * 1024):
                self.size += len(chunk)
                if self.size > self.limit:
                    raise _too_large(self.limit)
                if self.size > self.room:
                    raise _over_quota(self.quota)
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
        now = now_s()
        expires = self.expires_at(now)
        row = FileRow(0, new_id("file-"), owner, "batch", self.filename, self.size, now, expires)
        staged, self.tmp = self.tmp, None
        try:
            return await self.store.call(self.store.db.add_file, row, staged)
        finally:
            await asyncio.to_thread(staged.unlink, True)

    async def discard(self) -> None:
        if self.tmp is not None:
            await asyncio.to_thread(self.tmp.unlink, True)
            self.tmp = None


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
    """The uploaded file's name as shown back: its last path part, bounded; a control
    character in it is the client's error (400), never a 500."""
    if name is not None and any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidRequest("The file name holds a control character.", param="file")
    base = os.path.basename((name or "").replace("\\", "/"))
    base = "".join(c for c in base if c.isprintable())[:255]
    return base or "upload.jsonl"
