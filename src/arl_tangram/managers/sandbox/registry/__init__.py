"""Task images from registries: references, the distribution protocol's client side, pulls into
the image store (``pull``), and the ``[[registries]]`` config."""

from .config import RegistriesConfig, RegistryConfigError, RegistryHost
from .errors import DigestMismatch, NoPlatform, NotFound, RegistryError, TooLarge, Unauthorized, Unreachable
from .pull import PullEvent, PullLimits, pull, pull_sync, store_name
from .reference import BadReference, Reference, parse

__all__ = ["BadReference", "DigestMismatch", "NoPlatform", "NotFound", "PullEvent", "PullLimits", "Reference",
           "RegistriesConfig", "RegistryConfigError", "RegistryError", "RegistryHost", "TooLarge", "Unauthorized",
           "Unreachable", "parse", "pull", "pull_sync", "store_name"]
