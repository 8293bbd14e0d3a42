"""What a web page in the user's browser may do to a local server: nothing it could not do to any site.

Three checks before any route runs (an ASGI middleware, so 404s and 405s are covered too):
- **Host.** A page on evil.example can point its own DNS name at 127.0.0.1 (DNS rebinding) and read the
  answers as same-origin; its requests then carry `Host: evil.example`. Only the allowed host names pass
  (loopback names by default, as Jupyter and llama-server do).
- **Origin.** A request a browser sends from another site's page carries that site's `Origin`; it passes
  only where the origin is listed in `cors_origins` or names an allowed host.
- **Content-Type.** Browsers send `text/plain`, form and multipart POSTs cross-site without asking the
  server first (no CORS preflight); a POST here must say `application/json`, which they cannot send
  unasked.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from starlette.responses import JSONResponse

#: the host names a loopback server answers to by default
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def _localhost_name(name: str) -> bool:
    """localhost and its subdomains, which resolve to loopback by RFC 6761: no page can rebind them."""
    return name == "localhost" or name.endswith(".localhost")


def is_loopback(host: str) -> bool:
    """Whether a bind address only listens on this machine (a name like localhost counts)."""
    host = host.strip("[]")
    if _localhost_name(host.lower()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str | None:
    """The name in a Host header without its port (`[::1]:8000` -> `::1`), lower-case; None if malformed."""
    header = header.strip().lower()
    if not header:
        return None
    if header.startswith("["):
        end = header.find("]")
        rest = header[end + 1 :]
        if end < 0 or rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return header[1:end] or None
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    return name.rstrip(".") or None


class HostRules:
    """Which Host names and Origins may use the server. `hosts`: names (`.example.com` also matches its
    subdomains, `*` any host); `origins`: full origins (`https://app.example`, `*` any)."""

    def __init__(self, hosts: Iterable[str] | None = None, origins: Iterable[str] = ()) -> None:
        self.hosts = {h.strip().lower().rstrip(".").strip("[]") for h in (LOOPBACK_HOSTS if hosts is None else hosts)}
        self.hosts.discard("")
        self.origins = {o.strip().rstrip("/").lower() for o in origins if o.strip()}

    def host_ok(self, name: str | None) -> bool:
        if "*" in self.hosts:
            return True
        if name is None:
            return False
        if name in self.hosts:
            return True
        if _localhost_name(name) and "localhost" in self.hosts:
            return True
        return any(h.startswith(".") and (name.endswith(h) or name == h[1:]) for h in self.hosts)

    def origin_ok(self, origin: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        if origin == "null":
            return False  # sandboxed frames and file:// pages
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and self.host_ok(host_name(parts.netloc))


class BrowserGuard:
    """The ASGI middleware applying HostRules and the JSON Content-Type rule to every HTTP request."""

    def __init__(self, app: ASGIApp, rules: HostRules,
                 error: Callable[[int, str, str], JSONResponse]) -> None:
        self.app, self.rules, self.error = app, rules, error

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> JSONResponse | None:
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        if not self.rules.host_ok(host_name(headers.get("host", ""))):
            return self.error(403, "this Host is not allowed (serve --allowed-hosts lists the names the server "
                                   "answers to)", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.rules.origin_ok(origin):
            return self.error(403, "requests from this Origin are not allowed (serve --cors-origins lists the "
                                   "web pages that may call the server)", "origin_not_allowed")
        if scope.get("method") == "POST":
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return self.error(415, "a POST body must be sent as Content-Type: application/json",
                                  "unsupported_media_type")
        return None
