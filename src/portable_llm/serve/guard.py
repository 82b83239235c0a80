"""Who may talk to the server: the ``Host`` and ``Origin`` checks that keep web pages out (DNS
rebinding, cross-site "simple" POSTs), the JSON-only bodies, and the API key's rules.

Each rule lives here once; :func:`~portable_llm.serve.app.create_app` and the ``serve`` command
line both call these functions (docs/security.md says why each exists).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from portable_llm.serve.protocol import APIError, error_body

__all__ = [
    "LOCAL_HOSTS",
    "HostGuard",
    "check_api_key",
    "check_json_body",
    "host_allowed",
    "host_name",
    "keys_equal",
    "normalize_hosts",
    "normalize_origins",
]

#: Names every server accepts in ``Host`` (a browser that sends one of them runs on this machine).
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: In an allowed-hosts list, the wildcard addresses admit any address literal of the IP
#: versions they listen on (``::`` takes IPv4 clients too, as Linux binds it dual-stack).
_ANY_ADDRESS = {"0.0.0.0": (4,), "::": (4, 6)}
#: The longest API key.
MAX_KEY = 256


def check_api_key(key: str | None, *, name: str = "api_key") -> str | None:
    """``key`` if it is ``None`` or 1 to :data:`MAX_KEY` printable ASCII characters without
    spaces (what an ``Authorization`` header carries unchanged), else a ``ValueError`` naming
    ``name``: an empty key would let ``Bearer `` pass, a non-ASCII one no client can send."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"{name}: expected a string or None, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{name}: is empty (an unset variable?); give a key or none at all")
    if len(key) > MAX_KEY or not all("!" <= c <= "~" for c in key):
        raise ValueError(
            f"{name}: must be 1 to {MAX_KEY} printable ASCII characters without spaces "
            f"(got {len(key)} characters)"
        )
    return key


def keys_equal(given: str, key: str) -> bool:
    """Whether ``given`` is ``key``, in a time that says nothing about either: both are hashed
    first, so even their lengths stay hidden from ``hmac.compare_digest``."""
    a = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
    return hmac.compare_digest(a, hashlib.sha256(key.encode()).digest())


def host_name(header: str) -> str | None:
    """The host of a ``Host`` header, lower case, without its port and a final ``.``
    (``[::1]:8000`` -> ``::1``); ``None`` when it is malformed."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal: [addr] or [addr]:port
        end = header.find("]")
        rest = header[end + 1 :] if end > 0 else "?"
        if end < 0 or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        return header[1:end]
    name, colon, port = header.rpartition(":")
    if not colon:
        name = port
    elif not port.isdigit() or ":" in name:
        return None
    name = name[:-1] if name.endswith(".") else name  # "localhost." is "localhost"
    return name or None


def normalize_hosts(hosts: Iterable[str], *, name: str = "allowed_hosts") -> frozenset[str]:
    """Host names (any port) a ``Host`` header may name, on top of :data:`LOCAL_HOSTS`:
    lower case, brackets of IPv6 literals dropped; ``0.0.0.0`` admits any IPv4 address, ``::``
    any IPv4 or IPv6 address, ``*`` any host. A ``ValueError`` naming ``name`` for an entry
    that is empty, holds a port, a scheme or a space."""
    if isinstance(hosts, str):
        raise TypeError(f"{name}: expected a list of host names, got a string")
    out = set(LOCAL_HOSTS)
    for entry in hosts:
        if not isinstance(entry, str):
            raise TypeError(f"{name}: expected host names, got {type(entry).__name__}")
        text = entry.strip().lower()
        host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        if host == "*":
            out.add(host)
            continue
        address = _address(host)
        if address is not None:
            out.add(str(address))  # one spelling per address
            continue
        if not host or not all(c.isalnum() or c in "-._" for c in host) or not host.isascii():
            raise ValueError(
                f"{name}: {entry!r} is not a host name or address (give names such as "
                "'myhost.lan' or '192.168.1.5', without scheme or port)"
            )
        out.add(host.rstrip("."))
    return frozenset(out)


def normalize_origins(origins: Iterable[str], *, name: str = "allowed_origins") -> tuple[str, ...]:
    """Origins (``scheme://host[:port]``, exactly as a browser sends them in ``Origin``) whose
    pages may call the server through CORS; a ``ValueError`` naming ``name`` for anything
    else (a path, a wildcard, no scheme)."""
    if isinstance(origins, str):
        raise TypeError(f"{name}: expected a list of origins, got a string")
    out = []
    for entry in origins:
        if not isinstance(entry, str):
            raise TypeError(f"{name}: expected origins, got {type(entry).__name__}")
        origin = entry.strip().rstrip("/")
        try:
            parts = urlsplit(origin)
            ok = parts.port is None or parts.port > 0
        except ValueError:
            ok = False
        if not (
            ok and parts.scheme in ("http", "https") and parts.hostname
            and not (parts.path or parts.query or parts.fragment or parts.username)
            and origin.isascii() and "*" not in origin
        ):  # fmt: skip
            raise ValueError(
                f"{name}: {entry!r} is not an origin; give scheme://host[:port] exactly as the "
                "browser sends it, such as 'http://localhost:3000'"
            )
        out.append(origin.lower())
    return tuple(dict.fromkeys(out))


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an address when it is an address literal, else ``None``."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_allowed(host: str | None, allowed: frozenset[str]) -> bool:
    """Whether the host of a ``Host`` header (:func:`host_name`) is in ``allowed``
    (:func:`normalize_hosts`)."""
    if host is None:
        return False
    if "*" in allowed or host in allowed:
        return True
    address = _address(host)
    if address is None:
        return False  # a name not in the list
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    if str(address) in allowed or (mapped is not None and str(mapped) in allowed):
        return True
    return any(address.version in _ANY_ADDRESS.get(a, ()) for a in allowed)


class HostGuard:
    """ASGI middleware: an HTTP request whose ``Host`` is not an allowed host gets 400
    ``invalid_host`` (DNS rebinding); one with an ``Origin`` header that is not an allowed
    origin gets 403 ``origin_not_allowed`` (a cross-site request, a CORS preflight included).
    Nothing else of the request is read first."""

    def __init__(self, app: ASGIApp, *, hosts: frozenset[str], origins: tuple[str, ...]):
        self.app, self.hosts, self.origins = app, hosts, frozenset(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"] if k.lower() in (b"host", b"origin")}
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if not host_allowed(host_name(host), self.hosts):
            shown = host[:100].encode("unicode_escape").decode("ascii")
            await _refuse(
                send, 400, "invalid_host",
                f"Host {shown!r} is not an allowed host of this server (see --allowed-hosts)",
            )  # fmt: skip
            return
        if origin is not None and not _origin_allowed(origin.decode("latin-1"), host, self.origins):
            shown = origin[:100].decode("latin-1").encode("unicode_escape").decode("ascii")
            await _refuse(
                send, 403, "origin_not_allowed",
                f"requests from the web page origin {shown!r} are not allowed (see "
                "--allowed-origins)",
            )  # fmt: skip
            return
        await self.app(scope, receive, send)


def _origin_allowed(origin: str, host: str, allowed: frozenset[str]) -> bool:
    """Whether a request with this ``Origin`` may go on: an allowed origin, or the server's own
    (its host and port are the ``Host`` header's, already checked): the chat page at ``/``
    calls ``/v1`` from there, and a browser sends ``Origin`` on a same-origin POST too."""
    origin = origin.lower()
    scheme, _, rest = origin.partition("://")
    own = scheme in ("http", "https") and rest == host.strip().lower()
    return own or origin in allowed


async def _refuse(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps(error_body(message, type="invalid_request_error", code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def check_json_body(content_type: str | None) -> None:
    """An :class:`APIError` 415 unless ``content_type`` is ``application/json`` (parameters
    such as ``charset=utf-8`` allowed): a web page can send any other type without asking the
    browser's CORS preflight first."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise APIError(
            f"the request body must be JSON with 'Content-Type: application/json' (got "
            f"{(content_type or 'none')[:100]!r})",
            status=415, code="unsupported_media_type",
        )  # fmt: skip
