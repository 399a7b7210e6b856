"""What a pull can fail with. Every one is an ``ImageError`` (a 4xx where a request named the
image) whose message starts with the reference as given."""

from __future__ import annotations

from ..images import ImageError


class RegistryError(ImageError):
    """A registry did not give us the image."""


class Unauthorized(RegistryError):
    """401/403: no credentials, or credentials the registry refused."""


class NotFound(RegistryError):
    """404: no such repository, tag, manifest or blob."""


class NoPlatform(RegistryError):
    """An image index without a linux/amd64 image."""


class DigestMismatch(RegistryError):
    """Content whose sha256 is not the digest that named it (or longer than its declared size)."""


class Unreachable(RegistryError):
    """The registry did not answer, or kept answering 429/5xx past the retries: not the
    request's failure (an action it ends is ``infra_error``)."""

    infra = True


class TooLarge(RegistryError):
    """A manifest past the bounds: too many layers, too many declared bytes, a huge document."""
