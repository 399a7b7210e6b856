"""Authentication to a registry: anonymous first, then what its ``WWW-Authenticate`` asks for.

``Bearer realm=...,service=...,scope=...`` (Docker Hub, ghcr, the distribution registry's token
auth): a token is fetched from the realm, with basic credentials if there are any for the host
(anonymous tokens are how public images on Docker Hub and ghcr are read), and kept per host and
repository until it expires. ``Basic realm=...``: the credentials go with every request to that
host. No credentials where a registry demands them is an ``Unauthorized`` naming the reference.
Credentials never travel over plain HTTP to a host the config does not name insecure.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .errors import Unauthorized

_PARAM = re.compile(r'\s*([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,"]*))\s*,?')
_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9_-]*)(?:\s+|$)")
#: a token without ``expires_in`` lives this long (the distribution spec's default)
DEFAULT_TOKEN_S = 60.0


@dataclass(frozen=True)
class Challenge:
    scheme: str  # "bearer" or "basic" (lower case)
    params: dict[str, str] = field(default_factory=dict)


def parse_challenges(header: str) -> list[Challenge]:
    """Every challenge of a ``WWW-Authenticate`` value: ``Bearer realm="...",service="..."``;
    several may follow one another (``Basic realm="x", Bearer realm="y"``)."""
    out: list[Challenge] = []
    pos = 0
    while pos < len(header):
        m = _SCHEME.match(header, pos)
        if not m:
            break
        scheme, pos = m.group(1).lower(), m.end()
        params: dict[str, str] = {}
        while pos < len(header):
            p = _PARAM.match(header, pos)
            if not p:  # a word with no "=" after it: the next challenge's scheme
                break
            value = p.group(2) if p.group(2) is not None else p.group(3)
            params[p.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
            pos = p.end()
        out.append(Challenge(scheme, params))
        while pos < len(header) and header[pos] in " ,":
            pos += 1
    return out


def basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()


@dataclass
class _Grant:
    header: str
    expires: float  # time.monotonic(); inf for basic


class Authenticator:
    """The Authorization header per (host, repository), learnt from challenges."""

    def __init__(self, credentials, plain_http_ok) -> None:
        #: ``credentials(host) -> (user, password) | None``; ``plain_http_ok(host) -> bool``
        self.credentials = credentials
        self.plain_http_ok = plain_http_ok
        self.grants: dict[tuple[str, str], _Grant] = {}

    def header(self, host: str, repository: str) -> str | None:
        g = self.grants.get((host, repository))
        if g is None or g.expires <= time.monotonic():
            return None
        return g.header

    def forget(self, host: str, repository: str) -> None:
        self.grants.pop((host, repository), None)

    def plan(self, ref: str, host: str, repository: str, www_authenticate: str):
        """What to do about a 401 from ``host``: ``("basic", header)`` to retry with, or
        ``("token", url, params, auth_header_or_None, scheme)`` to fetch a token first."""
        challenges = parse_challenges(www_authenticate or "")
        bearer = next((c for c in challenges if c.scheme == "bearer" and c.params.get("realm")), None)
        creds = self.credentials(host)
        if bearer is not None:
            realm = bearer.params["realm"]
            parts = urlsplit(realm)
            if parts.scheme not in ("https", "http") or not parts.netloc:
                raise Unauthorized(f"{ref}: {host} asks for a token from {realm!r}, which is not an http(s) URL")
            if parts.scheme == "http" and not (self.plain_http_ok(host) or self.plain_http_ok(parts.netloc)):
                raise Unauthorized(f"{ref}: {host} asks for a token over plain HTTP ({realm}); name the host "
                                   "insecure in [[registries]] to allow it")
            params = {}
            if bearer.params.get("service"):
                params["service"] = bearer.params["service"]
            params["scope"] = bearer.params.get("scope") or f"repository:{repository}:pull"
            return ("token", realm, params, basic(*creds) if creds else None)
        if any(c.scheme == "basic" for c in challenges):
            if creds is None:
                raise Unauthorized(f"{ref}: {host} asks for a username and password (HTTP 401): give them in a "
                                   f"[[registries]] table for {host!r} or log in with docker login")
            header = basic(*creds)
            self.grants[(host, repository)] = _Grant(header, float("inf"))
            return ("basic", header)
        raise Unauthorized(f"{ref}: {host} refused the request (HTTP 401) and says no way to authenticate "
                           f"({www_authenticate!r})")

    def take_token(self, ref: str, host: str, repository: str, body: object) -> str:
        """Keep the token of a token service's answer; returns the header to use."""
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise Unauthorized(f"{ref}: the token service of {host} answered without a token")
        try:
            life = float(body.get("expires_in") or DEFAULT_TOKEN_S)
        except (TypeError, ValueError):
            life = DEFAULT_TOKEN_S
        header = f"Bearer {token}"
        # renew a little early: a request started just before expiry must not carry a dead token
        self.grants[(host, repository)] = _Grant(header, time.monotonic() + max(1.0, life - 5.0))
        return header
