"""Real registries for the tests: Debian's CNCF distribution registry (``docker-registry``) on
loopback, images written as OCI layouts here and pushed with ``skopeo``, a token service, and an
HTTP proxy in front of a registry that counts requests and misbehaves on demand.

Nothing here reaches outside 127.0.0.1. ``MISSING`` names the tools that are not installed
(``apt-get install -y docker-registry skopeo``); the tests skip naming them.
"""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from imagekit import layer_tar

from arl_tangram.bench import taskimages
from arl_tangram.bench.taskimages import MISSING, compress, free_port, push  # noqa: F401 (the tests' names)

REGISTRY, SKOPEO = taskimages.REGISTRY, taskimages.SKOPEO


# -- the registry --------------------------------------------------------------------------------

class Registry(taskimages.Registry):
    """``docker-registry serve`` on 127.0.0.1 with its storage in ``root``. ``auth``: None,
    ``("htpasswd", {user: password})`` or ``("token", TokenServer)``; ``proxy_of``: a URL to be a
    pull-through cache of."""

    def __init__(self, root: Path, auth: tuple | None = None, proxy_of: str | None = None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        lines: list[str] = []
        if auth is not None and auth[0] == "htpasswd":
            pw = root / "htpasswd"
            pw.write_text("".join(f"{u}:{_bcrypt(p)}\n" for u, p in auth[1].items()))
            lines += ["auth:", "  htpasswd:", "    realm: test-realm", f"    path: {pw}"]
        elif auth is not None and auth[0] == "token":
            ts: TokenServer = auth[1]
            lines += ["auth:", "  token:", f"    realm: {ts.url}/token", f"    service: {ts.service}",
                      f"    issuer: {ts.issuer}", f"    rootcertbundle: {ts.cert}"]
        if proxy_of:
            lines += ["proxy:", f"  remoteurl: {proxy_of}"]
        super().__init__(root, lines)


def _bcrypt(password: str) -> str:
    """A bcrypt hash, the only kind the registry's htpasswd reads: Python's crypt (3.12 and
    before; Debian's libcrypt does bcrypt), else the bcrypt package, else htpasswd(1)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import crypt

            return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
        except ImportError:
            pass
    try:
        import bcrypt

        return bcrypt.hashpw(password.encode(), bcrypt.gensalt()).decode()
    except ImportError:
        pass
    if shutil.which("htpasswd"):
        out = subprocess.run(["htpasswd", "-nbB", "u", password], capture_output=True, text=True, check=True)
        return out.stdout.strip().partition(":")[2]
    import pytest

    pytest.skip("no bcrypt here for an htpasswd file (Python's crypt, the bcrypt package or htpasswd)")


# -- images as OCI layouts, pushed with skopeo -----------------------------------------------------

@dataclass
class Layout(taskimages.Layout):
    """An OCI image layout directory being written, its layers given as the tests' entries."""

    def image(self, layers: list[list[tuple]], compression: str | list[str] = "gzip", env: list[str] | None = None,
              arch: str = "amd64", raw_tars: list[bytes] | None = None) -> dict:
        """Write one image's blobs; returns its manifest descriptor (with its platform)."""
        tars = raw_tars if raw_tars is not None else [layer_tar(e) for e in layers]
        return self.image_of(tars, compression, env, arch)


# -- a token service (the distribution registry's "token" auth) ------------------------------------

class TokenServer:
    """Issues JWTs (RS256, the signing certificate in ``x5c``) the registry checks against
    ``cert``. ``users``: {name: password}; anonymous callers get ``pull`` on ``public``
    repositories only; a user gets what it asks for. ``calls`` counts token requests."""

    def __init__(self, root: Path, users: dict[str, str], public: set[str] = frozenset()) -> None:
        self.users, self.public = users, set(public)
        self.service, self.issuer = "test-registry", "test-issuer"
        self.key, self.cert = root / "token.key", root / "token.crt"
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "1", "-subj", "/CN=tangram-test-token"],
                       check=True, capture_output=True)
        pem = self.cert.read_text()
        self.x5c = "".join(line for line in pem.splitlines() if "-----" not in line)
        self.calls = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                outer.calls += 1
                q = urllib.parse.urlsplit(self.path)
                params = urllib.parse.parse_qs(q.query)
                user = None
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    name, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
                    if outer.users.get(name) != pw:
                        self.send_response(401)
                        self.end_headers()
                        return
                    user = name
                access = []
                for scope in params.get("scope", []):
                    kind, _, rest = scope.partition(":")
                    name, _, actions = rest.rpartition(":")
                    wanted = actions.split(",")
                    granted = wanted if user else (["pull"] if name in outer.public and "pull" in wanted else [])
                    if granted:
                        access.append({"type": kind, "name": name, "actions": granted})
                body = json.dumps({"token": outer.sign(user or "", access), "expires_in": 300}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sign(self, subject: str, access: list[dict]) -> str:
        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": os.urandom(8).hex(), "access": access}
        signing = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing.encode(),
                             capture_output=True, check=True).stdout
        return f"{signing}.{b64(sig)}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- a proxy that counts and misbehaves ------------------------------------------------------------

@dataclass
class Rule:
    """Applies to ``times`` GETs whose path contains ``match``, after the first ``after`` of
    them. ``action``:
    ``("status", code, retry_after)``, ``("corrupt",)`` (one byte of the body flipped),
    ``("cut", n)`` (n bytes of the body, then the connection closed), ``("stall", n)`` (n bytes,
    then nothing until the proxy closes), ``("body", bytes, content_type)`` (this answer
    instead), ``("delay", seconds)``, ``("whole",)`` (only for a GET with a Range: the whole
    blob instead, as a registry that serves no ranges answers)."""

    match: str
    action: tuple
    times: int = 1
    after: int = 0


class Proxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (host:port). ``hits`` counts GETs per
    path; ``rules`` are consulted in order."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.rules: list[Rule] = []
        self.hits: dict[str, int] = {}
        self.ranges: list[str] = []  # the Range headers asked for
        self.agents: dict[str, int] = {}  # GETs by User-Agent's first word (arl-tangram: ours)
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:
                pass

            def do_GET(self) -> None:
                outer._handle(self)

            def do_HEAD(self) -> None:  # a pull-through cache asks the origin what a blob is
                outer._handle(self, head=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def blob_gets(self, digest: str | None = None) -> int:
        return sum(n for p, n in self.hits.items() if "/blobs/" in p and (digest is None or digest in p))

    def _rule(self, path: str, ranged: bool = False) -> Rule | None:
        with self.lock:
            self.hits[path] = self.hits.get(path, 0) + 1
            for r in self.rules:
                if r.match in path and r.times > 0 and (ranged or r.action[0] != "whole"):
                    if r.after > 0:
                        r.after -= 1
                        continue
                    r.times -= 1
                    return r
        return None

    def _handle(self, h: http.server.BaseHTTPRequestHandler, head: bool = False) -> None:
        if head:
            conn = self._forward(h, "HEAD")
            resp = conn.getresponse()
            resp.read()
            conn.close()
            h.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "transfer-encoding"):
                    h.send_header(k, v)
            h.end_headers()
            return
        rule = self._rule(h.path, bool(h.headers.get("Range")))
        agent = (h.headers.get("User-Agent") or "-").split("/")[0].split()[0]
        with self.lock:
            self.agents[agent] = self.agents.get(agent, 0) + 1
            self.log.append((agent, h.path))
        if h.headers.get("Range"):
            self.ranges.append(h.headers["Range"])
        action = rule.action if rule else ("pass",)
        if action[0] == "status":
            body = b'{"errors": [{"code": "UNAVAILABLE", "message": "try later"}]}'
            h.send_response(action[1])
            if action[2] is not None:
                h.send_header("Retry-After", str(action[2]))
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
            return
        if action[0] == "body":
            h.send_response(200)
            h.send_header("Content-Type", action[2])
            h.send_header("Content-Length", str(len(action[1])))
            h.end_headers()
            h.wfile.write(action[1])
            return
        if action[0] == "delay":
            time.sleep(action[1])
        conn = self._forward(h, "GET", whole=action[0] == "whole")
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        if action[0] == "corrupt" and body:
            body = body[:-1] + bytes([body[-1] ^ 0xFF])
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        if action[0] in ("cut", "stall"):
            h.send_header("Connection", "close")
        h.end_headers()
        if action[0] == "cut":
            h.wfile.write(body[:action[1]])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if action[0] == "stall":
            h.wfile.write(body[:action[1]])
            h.wfile.flush()
            self.release.wait(60)
            h.close_connection = True
            return
        h.wfile.write(body)

    def _forward(self, h: http.server.BaseHTTPRequestHandler, method: str,
                 whole: bool = False) -> http.client.HTTPConnection:
        """The request sent on upstream, every header line kept (Go's clients send one Accept
        line per media type); ``whole``: without its Range (as a registry that serves none)."""
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        conn.putrequest(method, h.path, skip_accept_encoding=True)
        for k, v in h.headers.items():
            if k.lower() not in ("connection", "host") and not (whole and k.lower() == "range"):
                conn.putheader(k, v)
        conn.endheaders()
        return conn

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
