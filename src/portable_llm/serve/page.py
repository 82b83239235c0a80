"""``GET /``: the chat page, one static file (``static/chat.html``, package data) whose script
talks to the server's own ``/v1/chat/completions``.

The page is sent with a Content-Security-Policy that lets it load nothing and connect nowhere
but this server, and run only its own inline script and style (named by their SHA-256).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib import resources

from starlette.requests import Request
from starlette.responses import Response

__all__ = ["chat_page", "page_headers", "page_html"]


@functools.cache
def page_html() -> bytes:
    """The page's bytes, read once from the package."""
    return resources.files("portable_llm.serve").joinpath("static/chat.html").read_bytes()


def _hashes(html: str, tag: str) -> str:
    """CSP sources for the inline ``<tag>`` blocks of ``html``: ``'sha256-...'`` each."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.DOTALL)
    digests = (base64.b64encode(hashlib.sha256(b.encode()).digest()).decode() for b in blocks)
    return " ".join(f"'sha256-{d}'" for d in digests)


@functools.cache
def page_headers() -> dict[str, str]:
    """The page's response headers: the CSP (no source but this server, the page's own script
    and style by hash), no sniffing, no referrer, no framing."""
    html = page_html().decode()
    policy = (
        "default-src 'none'; "
        f"script-src {_hashes(html, 'script')}; "
        f"style-src {_hashes(html, 'style')}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cache-Control": "no-cache",
    }


async def chat_page(request: Request) -> Response:
    """The Starlette endpoint of ``GET /`` (open without the API key: the page asks for it)."""
    return Response(page_html(), media_type="text/html; charset=utf-8", headers=page_headers())
