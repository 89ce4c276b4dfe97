"""`GET /dashboard`: a live, self-contained page of /admin/state for people.

The page is `dashboard.html` beside this module (package data): inline CSS and JS, no build
step, no external URL. It holds no data itself: once a second it fetches `admin/state` with the
admin key (from `#key=...` or its key box, kept in sessionStorage) as a Bearer header, and draws
the pools, their instances and the state changes it saw between two snapshots.
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["render"]


@functools.cache
def render() -> bytes:
    """The page's bytes (HTML with inline CSS and JS; no build step, no CDN), read once."""
    return resources.files("gateway").joinpath("dashboard.html").read_bytes()
