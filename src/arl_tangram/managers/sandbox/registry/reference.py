"""Registry references: ``python:3.12``, ``ghcr.io/org/repo:tag``, ``host:port/a/b@sha256:...``.

Docker's rules for what a short name means: a first component with a ``.`` or a ``:``, or
``localhost``, is a registry host; anything else is on Docker Hub, where a one-component name is
an official image (``python`` is ``docker.io/library/python``). No tag and no digest means
``latest``; with a digest the digest alone picks the image (a tag beside it is kept for display).
Every error names the reference as it was given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..images import ImageError

DOCKER_HUB = "docker.io"
#: where Docker Hub's registry API answers (``docker.io`` itself only redirects to the web site)
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = {"docker.io", "index.docker.io", "registry-1.docker.io"}

_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")
MAX_REFERENCE = 255


class BadReference(ImageError):
    """A reference that does not parse; the message quotes it."""


@dataclass(frozen=True)
class Reference:
    """A parsed reference: ``registry`` (``docker.io`` for Docker Hub), ``repository``
    (``library/python``), and a ``tag`` or a ``digest`` (or both)."""

    registry: str
    repository: str
    tag: str = ""
    digest: str = ""

    @property
    def name(self) -> str:
        """``registry/repository``, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def api_host(self) -> str:
        """The host that answers the registry API for ``registry``."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def selector(self) -> str:
        """What the manifest request names: the digest if there is one, else the tag."""
        return self.digest or self.tag

    def __str__(self) -> str:
        out = self.name
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, self.tag, digest)


def is_host(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost" or component.startswith("[")


def normalise_host(host: str, where: str) -> str:
    """A registry host as the config and references name it (``index.docker.io`` is ``docker.io``)."""
    if not _HOST.match(host):
        raise BadReference(f"{where}: {host!r} is not a registry host (host or host:port)")
    port = host.rsplit(":", 1)[1] if ":" in host and not host.endswith("]") else None
    if port is not None and not 0 < int(port) < 65536:
        raise BadReference(f"{where}: {host!r} has a port out of range")
    low = host.lower()
    return DOCKER_HUB if low in _HUB_ALIASES else low


def parse(text: str) -> Reference:
    """Parse a reference; ``BadReference`` naming ``text`` if it is not one."""
    if not isinstance(text, str) or not text:
        raise BadReference(f"image reference {text!r}: empty")
    if len(text) > MAX_REFERENCE:
        raise BadReference(f"image reference {text[:60]!r}...: longer than {MAX_REFERENCE} characters")

    def bad(why: str) -> BadReference:
        return BadReference(f"image reference {text!r}: {why}")

    rest, digest = text, ""
    if "@" in rest:
        rest, _, digest = rest.partition("@")
        if not _DIGEST.match(digest):
            raise bad(f"{digest!r} is not a sha256 digest (sha256: and 64 lowercase hex digits)")
    tag = ""
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.match(tag):
            raise bad(f"{tag!r} is not a valid tag (letters, digits, _ . -; 128 at most)")
    parts = rest.split("/")
    if len(parts) > 1 and is_host(parts[0]):
        try:
            registry = normalise_host(parts[0], f"image reference {text!r}")
        except BadReference:
            raise bad(f"{parts[0]!r} is not a registry host") from None
        parts = parts[1:]
    else:
        registry = DOCKER_HUB
    for p in parts:
        if not _COMPONENT.match(p):
            raise bad(f"{p!r} is not a valid repository name component (lowercase letters, digits, "
                      "separated by . _ __ or -)")
    if registry == DOCKER_HUB and len(parts) == 1:
        parts = ["library", *parts]
    if not tag and not digest:
        tag = "latest"
    return Reference(registry, "/".join(parts), tag, digest)
