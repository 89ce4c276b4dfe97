"""OpenAI's Batch API, executed by the gateway itself (SPEC §14).

"OpenAI's Batch API, executed by the gateway itself at low priority (the seed's overnight
re-judging): the official openai client's `client.files.*` and `client.batches.*` work
unchanged."

- `api.py`: the `/v1/files` and `/v1/batches` routes, OpenAI's shapes, ownership by key;
- `validate.py`: the input file, line by line, before anything runs;
- `runner.py`: the executor — each line through the gateway's `Executor.call` at low
  priority, fed gradually and fairly, retried with backoff, cancelled, expired, finalized;
- `store.py`: SQLite in WAL mode on one dedicated thread; files on disk beside it;
- `records.py`: the output and error lines as OpenAI writes them;
- `owners.py`: who owns what, and the tenant a batch's lines run as;
- `service.py`: the whole, as one gateway owns it (lazy open, lock, counts, start and stop);
  `BatchApi(service)` serves it;
- `ports.py`: what the gateway hands the service (executor, keys, settings, metrics).
"""

from __future__ import annotations

from gateway.batch.api import BatchApi
from gateway.batch.service import BatchService, StoreUnavailable

__all__ = ["BATCH_PATHS", "BatchApi", "BatchService", "StoreUnavailable"]

#: Paths under which `Gateway.handle` asks `BatchApi.route` (those with an id in them).
BATCH_PATHS = ("/v1/files/", "/v1/batches/")
