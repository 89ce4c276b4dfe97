"""`gateway check` of a cluster config without `replica_id`: the default is "host name + pid"
of the serving process (SPEC §13; with --workers, the supervisor's), so check names the host
and says the pid comes from `serve` — not its own pid, which names no replica that runs."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

GATEWAY = [sys.executable, "-m", "gateway.cli"]


def test_check_shows_the_default_replica_id_as_the_serving_process(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "pools:\n"
        "  p:\n"
        "    instances:\n"
        '      - {name: a, url: "http://127.0.0.1:9/v1", model: m, max_concurrency: 4}\n'
        "models:\n"
        "  m: {pool: p}\n"
        'cluster: {redis_url: "redis://127.0.0.1:6379/0"}\n'
    )
    out = subprocess.run([*GATEWAY, "check", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("cluster "))
    assert f"replica_id={socket.gethostname()}-<pid of serve>" in line, line
