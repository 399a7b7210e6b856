"""The client side of the OCI distribution protocol, over httpx.

``resolve`` reads a reference's manifest (an image index or a Docker manifest list becomes its
linux/amd64 image; Docker schema-2 and OCI image manifests), checking every document against
the digest that names it. ``fetch_blob`` streams a blob into a file, hashing as it goes; the
file is kept only if its size and sha256 are the ones the manifest declared. Every request goes
to the reference's mirrors first (as Docker's ``registry-mirrors`` and containerd's hosts do),
then to the origin; 429 and 5xx answers and dropped connections are retried with exponential
backoff, honouring ``Retry-After``; 401 goes through ``auth.Authenticator``. Plain HTTP only to
hosts the config names insecure.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import random
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import certifi
import httpx

from .auth import Authenticator
from .config import RegistriesConfig
from .errors import DigestMismatch, NoPlatform, NotFound, RegistryError, TooLarge, Unauthorized, Unreachable
from .reference import DOCKER_HUB, DOCKER_HUB_API, Reference

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_SCHEMA1 = ("application/vnd.docker.distribution.manifest.v1+json",
                  "application/vnd.docker.distribution.manifest.v1+prettyjws")
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
IMAGE_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
CONFIG_TYPES = ("application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json")
LAYER_TYPES = ("application/vnd.oci.image.layer.v1.tar", "application/vnd.oci.image.layer.v1.tar+gzip",
               "application/vnd.oci.image.layer.v1.tar+zstd", "application/vnd.docker.image.rootfs.diff.tar.gzip",
               "application/vnd.docker.image.rootfs.diff.tar", "application/vnd.docker.image.rootfs.diff.tar.zstd")
ACCEPT = ", ".join((*IMAGE_TYPES, *INDEX_TYPES))
RETRY_STATUS = (429, 500, 502, 503, 504)
#: the platform a pull picks from an index
PLATFORM = ("linux", "amd64")
#: a manifest or index larger than this is refused (the distribution registry's own limit)
MAX_MANIFEST_BYTES = 4 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int


@dataclass
class Manifest:
    """An image manifest, resolved: ``digest`` is the image manifest's own (not the index's)."""

    digest: str
    media_type: str
    config: Descriptor
    layers: list[Descriptor] = field(default_factory=list)
    index_digest: str = ""


@dataclass(frozen=True)
class Endpoint:
    host: str  # as the config names it (docker.io, 127.0.0.1:5000)
    base: str  # scheme://api-host
    mirror: bool


_TLS: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    """One verifying TLS context for every client of the process (the system's CAs, for private
    registries, and certifi's): building one costs a few hundred milliseconds, more than a small
    pull."""
    global _TLS
    if _TLS is None:
        ctx = ssl.create_default_context()
        ctx.load_verify_locations(certifi.where())
        _TLS = ctx
    return _TLS


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _descriptor(ref: Reference, raw: object, what: str) -> Descriptor:
    if not isinstance(raw, dict):
        raise RegistryError(f"{ref}: {what} is not a descriptor")
    digest, size = raw.get("digest"), raw.get("size")
    if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 71 \
            or any(c not in "0123456789abcdef" for c in digest[7:]):
        raise RegistryError(f"{ref}: {what} has an unsupported digest {digest!r} (sha256 only)")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise RegistryError(f"{ref}: {what} has no valid size ({size!r})")
    return Descriptor(str(raw.get("mediaType") or ""), digest, size)


def retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (seconds, or an HTTP date); None if absent."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class RegistryClient:
    """One pull's (or one node's) connection to registries: tokens are kept between requests.

    ``retries``: further tries of a request answered 429/5xx or cut (the origin's refused
    connections too; a mirror that does not answer is passed over at once); ``backoff_s``
    doubles each time, with jitter; a ``Retry-After`` longer than that is honoured up to
    ``max_wait_s``."""

    def __init__(self, config: RegistriesConfig | None = None, *, retries: int = 4, backoff_s: float = 0.5,
                 max_wait_s: float = 60.0, timeout_s: float = 60.0, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config or RegistriesConfig()
        self.retries, self.backoff_s, self.max_wait_s = retries, backoff_s, max_wait_s
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
                                      follow_redirects=True, transport=transport, verify=_tls(),
                                      headers={"User-Agent": "arl-tangram"})
        self.auth = Authenticator(self.config.credentials, self._insecure)
        self.dead: set[str] = set()  # mirrors that did not answer: not asked again by this client
        self.requests = 0

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "RegistryClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _insecure(self, host: str) -> bool:
        return any(r.host == host and r.insecure for r in self.config.registries)

    def endpoints(self, ref: Reference) -> list[Endpoint]:
        """The mirrors of ``ref``'s registry (first, in order), then the registry itself."""
        out = []
        for host in [*self.config.host(ref.registry).mirrors, ref.registry]:
            api = DOCKER_HUB_API if host == DOCKER_HUB else host
            scheme = "http" if self._insecure(host) else "https"
            out.append(Endpoint(host, f"{scheme}://{api}", host != ref.registry))
        return out

    # -- requests --------------------------------------------------------------------------------
    async def _wait(self, attempt: int, response: httpx.Response | None) -> None:
        delay = self.backoff_s * (2 ** attempt) * random.uniform(0.5, 1.0)
        told = retry_after(response.headers.get("retry-after")) if response is not None else None
        if told is not None:
            delay = max(delay, told)
        await asyncio.sleep(min(delay, self.max_wait_s))

    async def _send(self, ref: Reference, ep: Endpoint, path: str, headers: dict[str, str] | None = None
                    ) -> httpx.Response:
        """A streamed GET of ``path`` on ``ep``: a 2xx response (the caller closes it), after
        authentication and retries; otherwise a ``RegistryError`` naming ``ref``."""
        url = f"{ep.base}/v2/{ref.repository}/{path}"
        authed_once = False
        attempt = 0
        while True:
            hdrs = dict(headers or {})
            auth = self.auth.header(ep.host, ref.repository)
            if auth:
                hdrs["Authorization"] = auth
            self.requests += 1
            try:
                resp = await self.http.send(self.http.build_request("GET", url, headers=hdrs), stream=True)
            except httpx.TransportError as e:
                if isinstance(e, httpx.ConnectError) and "SSL" in str(e):  # no use trying again
                    raise Unreachable(f"{ref}: no TLS at {ep.host} ({e}); if it speaks plain HTTP, name it "
                                      "insecure in a [[registries]] table") from None
                if isinstance(e, httpx.ConnectError) and _no_such_host(e):  # no use trying again either
                    raise Unreachable(f"{ref}: cannot reach {ep.host}: no such host (or no network to look it "
                                      "up)") from None
                if ep.mirror and isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.dead.add(ep.host)
                    raise Unreachable(f"{ref}: mirror {ep.host} does not answer ({type(e).__name__}: {e})") \
                        from None
                if attempt >= self.retries:
                    raise Unreachable(f"{ref}: cannot reach {ep.host} ({type(e).__name__}: {e}) after "
                                      f"{attempt + 1} tries") from None
                await self._wait(attempt, None)
                attempt += 1
                continue
            if resp.status_code < 300:
                return resp
            await resp.aread()
            await resp.aclose()
            if resp.status_code == 401 and not authed_once:
                authed_once = True
                await self._authenticate(ref, ep, resp)
                continue
            if resp.status_code in RETRY_STATUS and attempt < self.retries:
                await self._wait(attempt, resp)
                attempt += 1
                continue
            raise self._error(ref, ep, path, resp, attempt)

    async def _authenticate(self, ref: Reference, ep: Endpoint, resp: httpx.Response) -> None:
        self.auth.forget(ep.host, ref.repository)
        plan = self.auth.plan(str(ref), ep.host, ref.repository, resp.headers.get("www-authenticate", ""))
        if plan[0] == "basic":
            return
        _, realm, params, basic_header = plan
        headers = {"Authorization": basic_header} if basic_header else {}
        for attempt in range(self.retries + 1):
            try:
                self.requests += 1
                tok = await self.http.get(realm, params=params, headers=headers)
            except httpx.TransportError as e:
                if attempt >= self.retries:
                    raise Unreachable(f"{ref}: cannot reach the token service {realm} ({type(e).__name__}: {e})") \
                        from None
                await self._wait(attempt, None)
                continue
            if tok.status_code in RETRY_STATUS and attempt < self.retries:
                await self._wait(attempt, tok)
                continue
            break
        if tok.status_code in (401, 403):
            raise Unauthorized(f"{ref}: the token service of {ep.host} refused "
                               f"{'the credentials' if basic_header else 'an anonymous token'} (HTTP "
                               f"{tok.status_code}){'' if basic_header else '; give credentials for ' + repr(ep.host)}")
        if tok.status_code >= 300:
            raise Unauthorized(f"{ref}: the token service of {ep.host} answered HTTP {tok.status_code}")
        try:
            body = tok.json()
        except ValueError:
            raise Unauthorized(f"{ref}: the token service of {ep.host} answered no JSON") from None
        self.auth.take_token(str(ref), ep.host, ref.repository, body)

    def _error(self, ref: Reference, ep: Endpoint, path: str, resp: httpx.Response, attempt: int) -> RegistryError:
        status = resp.status_code
        where = f"mirror {ep.host}" if ep.mirror else ep.host
        detail = _error_detail(resp)
        if status in (401, 403):
            return Unauthorized(f"{ref}: {where} refused access (HTTP {status}{detail}): no such image, or it needs "
                                f"credentials (a [[registries]] table for {ep.host!r}, or docker login)")
        if status == 404:
            what = "manifest" if path.startswith("manifests/") else f"blob {path.rpartition('/')[2]}"
            return NotFound(f"{ref}: not found at {where} (HTTP 404, {what}{detail})")
        if status in RETRY_STATUS:
            return Unreachable(f"{ref}: {where} answered HTTP {status}{detail} {attempt + 1} times")
        return RegistryError(f"{ref}: {where} answered HTTP {status}{detail}")

    async def _each_endpoint(self, ref: Reference, fn):
        """``fn(endpoint)`` on each endpoint in turn until one succeeds; the origin's error
        (with the mirrors' in brief) if none does."""
        errors: list[RegistryError] = []
        eps = self.endpoints(ref)
        for ep in eps:
            if ep.mirror and ep.host in self.dead:
                continue
            try:
                return await fn(ep)
            except RegistryError as e:
                errors.append(e)
        last = errors[-1]
        if len(errors) > 1:
            raise type(last)(f"{last} (mirrors: {'; '.join(str(e).removeprefix(str(ref) + ': ') for e in errors[:-1])})")
        raise last

    # -- documents -------------------------------------------------------------------------------
    async def _get_bytes(self, ref: Reference, ep: Endpoint, path: str, headers: dict[str, str] | None,
                         limit: int, message: str, error=TooLarge) -> tuple[bytes, httpx.Response]:
        """A whole (small) body, at most ``limit`` bytes; a body cut part way is asked again."""
        for attempt in range(self.retries + 1):
            resp = await self._send(ref, ep, path, headers)
            try:
                return await _read_bounded(resp, limit, message, error), resp
            except httpx.TransportError as e:
                if attempt >= self.retries:
                    raise Unreachable(f"{ref}: {path.partition('/')[0][:-1]} from {ep.host} was cut "
                                      f"{attempt + 1} times ({type(e).__name__})") from None
                await self._wait(attempt, None)
            finally:
                await resp.aclose()
        raise AssertionError("unreachable")

    async def _document(self, ref: Reference, ep: Endpoint, selector: str, max_bytes: int) -> tuple[bytes, str]:
        body, resp = await self._get_bytes(ref, ep, f"manifests/{selector}", {"Accept": ACCEPT}, max_bytes,
                                           f"{ref}: the manifest is larger than {max_bytes} bytes")
        digest = _sha256(body)
        if selector.startswith("sha256:") and digest != selector:
            raise DigestMismatch(f"{ref}: {ep.host} sent a manifest whose sha256 is {digest}, not {selector}")
        told = resp.headers.get("docker-content-digest")
        if not selector.startswith("sha256:") and told and told.startswith("sha256:") and told != digest:
            raise DigestMismatch(f"{ref}: {ep.host} sent a manifest whose sha256 is {digest}, but it says {told}")
        return body, resp.headers.get("content-type", "").split(";")[0].strip()

    async def resolve(self, ref: Reference, platform: tuple[str, str] = PLATFORM) -> Manifest:
        """The image manifest of ``ref`` for ``platform`` (an index picks it), every document
        checked against its digest."""
        return await self._each_endpoint(ref, lambda ep: self._resolve(ref, ep, platform))

    async def _resolve(self, ref: Reference, ep: Endpoint, platform: tuple[str, str]) -> Manifest:
        body, ctype = await self._document(ref, ep, ref.selector, MAX_MANIFEST_BYTES)
        doc = json_document(ref, body, "manifest")
        mtype = doc.get("mediaType") or ctype
        index_digest = ""
        if mtype in INDEX_TYPES or (not mtype and "manifests" in doc):
            index_digest = _sha256(body)
            chosen = _choose(ref, doc, platform)
            body, ctype = await self._document(ref, ep, chosen.digest, MAX_MANIFEST_BYTES)
            if len(body) != chosen.size:
                raise DigestMismatch(f"{ref}: the {'/'.join(platform)} manifest is {len(body)} bytes, its index "
                                     f"says {chosen.size}")
            doc = json_document(ref, body, "manifest")
            mtype = doc.get("mediaType") or ctype
            if mtype in INDEX_TYPES or "manifests" in doc:
                raise RegistryError(f"{ref}: an index inside an index is not supported")
        if mtype in DOCKER_SCHEMA1 or doc.get("schemaVersion") == 1:
            raise RegistryError(f"{ref}: a Docker schema-1 manifest (deprecated; push the image again with a "
                                "current client)")
        if mtype and mtype not in IMAGE_TYPES:
            raise RegistryError(f"{ref}: not a container image (manifest media type {mtype!r})")
        if not isinstance(doc.get("layers"), list):
            raise RegistryError(f"{ref}: the manifest lists no layers")
        config = _descriptor(ref, doc.get("config"), "the manifest's config")
        if config.media_type and config.media_type not in CONFIG_TYPES:
            raise RegistryError(f"{ref}: not a container image (config media type {config.media_type!r})")
        layers = [_descriptor(ref, d, f"layer {i}") for i, d in enumerate(doc["layers"])]
        for i, d in enumerate(layers):
            if d.media_type and d.media_type not in LAYER_TYPES:
                raise RegistryError(f"{ref}: layer {i} has an unsupported media type {d.media_type!r}")
        return Manifest(_sha256(body), mtype or IMAGE_TYPES[0], config, layers, index_digest)

    # -- blobs -----------------------------------------------------------------------------------
    async def fetch_small(self, ref: Reference, desc: Descriptor, max_bytes: int) -> bytes:
        """A small blob (an image config) in memory, checked against its digest."""
        if desc.size > max_bytes:
            raise TooLarge(f"{ref}: the image config declares {desc.size} bytes (at most {max_bytes})")

        async def one(ep: Endpoint) -> bytes:
            body, _ = await self._get_bytes(ref, ep, f"blobs/{desc.digest}", None, desc.size,
                                            f"{ref}: blob {desc.digest} is longer than its declared {desc.size} "
                                            "bytes", DigestMismatch)
            if _sha256(body) != desc.digest or len(body) != desc.size:
                raise DigestMismatch(f"{ref}: blob {desc.digest} from {ep.host} does not match its digest")
            return body

        return await self._each_endpoint(ref, one)

    async def fetch_blob(self, ref: Reference, desc: Descriptor, dest: Path | None,
                         on_bytes: Callable[[int], None] | None = None, tee: "Tee | None" = None) -> None:
        """Stream blob ``desc`` into the file ``dest`` (created or truncated; None: no file, the
        bytes go to ``tee`` only); raises ``DigestMismatch`` (and leaves ``dest`` to the caller to
        delete) unless its size and sha256 are the declared ones. A connection cut part way resumes with a Range request
        where the registry allows it. ``tee`` is handed each chunk as it is written, in order,
        from a worker thread, and told when the download starts over from its first byte."""
        await self._each_endpoint(ref, lambda ep: self._fetch_blob(ref, ep, desc, dest, on_bytes, tee))

    async def _fetch_blob(self, ref: Reference, ep: Endpoint, desc: Descriptor, dest: Path | None,
                          on_bytes: Callable[[int], None] | None, tee: "Tee | None" = None) -> None:
        sha = hashlib.sha256()
        done = 0
        buf = bytearray()
        if tee is not None:
            tee.restart()  # another endpoint after one that failed part way
        fh = await asyncio.to_thread(open, dest, "wb") if dest is not None else None
        try:
            for attempt in range(self.retries + 1):
                headers = {"Range": f"bytes={done}-"} if done else {}
                resp = await self._send(ref, ep, f"blobs/{desc.digest}", headers)
                try:
                    buf.clear()
                    if done and (resp.status_code != 206 or not resp.headers.get("content-range", "")
                                 .startswith(f"bytes {done}-")):  # no (such) range here: from the start
                        await asyncio.to_thread(_restart, fh, tee)
                        sha, done = hashlib.sha256(), 0
                    async for chunk in resp.aiter_bytes():  # as it arrives: a cut keeps what came
                        if done + len(buf) + len(chunk) > desc.size:
                            raise DigestMismatch(f"{ref}: blob {desc.digest} from {ep.host} is longer than its "
                                                 f"declared {desc.size} bytes")
                        buf += chunk
                        if len(buf) >= _CHUNK:
                            await asyncio.to_thread(_write, fh, sha, bytes(buf), tee)
                            done += len(buf)
                            buf.clear()
                            if on_bytes:
                                on_bytes(done)
                    if buf:
                        await asyncio.to_thread(_write, fh, sha, bytes(buf), tee)
                        done += len(buf)
                    if on_bytes:
                        on_bytes(done)
                    break
                except httpx.TransportError as e:
                    if buf:  # what arrived before the cut is kept
                        await asyncio.to_thread(_write, fh, sha, bytes(buf), tee)
                        done += len(buf)
                        buf.clear()
                    if attempt >= self.retries:
                        raise Unreachable(f"{ref}: blob {desc.digest} from {ep.host} was cut at {done} of "
                                          f"{desc.size} bytes {attempt + 1} times ({type(e).__name__})") from None
                    await self._wait(attempt, None)
                finally:
                    await resp.aclose()
        finally:
            if fh is not None:
                await asyncio.to_thread(fh.close)
        if done != desc.size or "sha256:" + sha.hexdigest() != desc.digest:
            raise DigestMismatch(f"{ref}: blob {desc.digest} from {ep.host} does not match its digest (got "
                                 f"{done} bytes, sha256:{sha.hexdigest()[:12]}...)")


class Tee(Protocol):
    """Where a blob's bytes go besides its file (``fetch_blob``)."""

    def write(self, data: bytes) -> None: ...

    def restart(self) -> None: ...


def _no_such_host(e: BaseException) -> bool:
    """The host's name does not resolve (EAI_NONAME), as opposed to a resolver that failed for now."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, socket.gaierror):
            return e.errno == socket.EAI_NONAME
        e = e.__cause__ or e.__context__
    return False


def _write(fh, sha, data: bytes, tee: Tee | None = None) -> None:
    sha.update(data)
    if fh is not None:
        fh.write(data)
    if tee is not None:
        tee.write(data)


def _restart(fh, tee: Tee | None = None) -> None:
    if fh is not None:
        fh.seek(0)
        fh.truncate()
    if tee is not None:
        tee.restart()


async def _read_bounded(resp: httpx.Response, limit: int, message: str, error=TooLarge) -> bytes:
    length = resp.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise error(message)
    out = bytearray()
    async for chunk in resp.aiter_bytes():
        out += chunk
        if len(out) > limit:
            raise error(message)
    return bytes(out)


def json_document(ref: Reference, body: bytes, what: str) -> dict:
    """A registry document (a manifest, an image config) as a JSON object, or an error naming ``ref``."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RegistryError(f"{ref}: the {what} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise RegistryError(f"{ref}: the {what} is not a JSON object")
    return doc


def _choose(ref: Reference, index: dict, platform: tuple[str, str]) -> Descriptor:
    entries = index.get("manifests")
    if not isinstance(entries, list):
        raise RegistryError(f"{ref}: the image index lists no manifests")
    seen, matches = [], []
    for i, raw in enumerate(entries):
        p = raw.get("platform") if isinstance(raw, dict) else None
        if not isinstance(p, dict):
            continue
        os_, arch = str(p.get("os", "")), str(p.get("architecture", ""))
        if os_ == "unknown":  # attestations (buildkit's provenance), not images
            continue
        seen.append(f"{os_}/{arch}" + (f"/{p['variant']}" if p.get("variant") else ""))
        if (os_, arch) == platform:
            matches.append((bool(p.get("variant")), i, raw))
    if not matches:
        raise NoPlatform(f"{ref}: no {'/'.join(platform)} image in its index (it has: "
                         f"{', '.join(seen) or 'none with a platform'})")
    matches.sort(key=lambda m: m[:2])  # one without a variant first, then the index's order
    return _descriptor(ref, matches[0][2], f"the {'/'.join(platform)} manifest")


def _error_detail(resp: httpx.Response) -> str:
    """The first error code and message of a registry's JSON error body, if any."""
    try:
        errs = resp.json().get("errors")
        e = errs[0]
        return f": {e.get('code', '')} {e.get('message', '')}".rstrip()
    except Exception:
        return ""
