"""`GET /dashboard`: a live, self-contained page of /admin/state for people (placeholder)."""

from __future__ import annotations

__all__ = ["render"]

_PAGE = b"""<!doctype html><html><head><meta charset="utf-8"><title>gateway</title></head>
<body><p>dashboard placeholder</p></body></html>"""


def render() -> bytes:
    """The page's bytes (HTML with inline CSS and JS; no build step, no CDN)."""
    return _PAGE
