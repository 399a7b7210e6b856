"""Task images from registries: references, the distribution protocol's client side, pulls into
the image store (``pull``), and the ``[[registries]]`` config.

Names are imported on first use: the config (``registry.config``) is read by every process that
reads a sandbox config, the client and its HTTP stack only by one that pulls."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "RegistriesConfig": "config", "RegistryConfigError": "config", "RegistryHost": "config",
    "DigestMismatch": "errors", "NoPlatform": "errors", "NotFound": "errors", "RegistryError": "errors",
    "TooLarge": "errors", "Unauthorized": "errors", "Unreachable": "errors",
    "PullEvent": "pulling", "PullLimits": "pulling", "prune": "pulling", "pull": "pulling", "pull_sync": "pulling",
    "store_name": "pulling",
    "BadReference": "reference", "Reference": "reference", "parse": "reference",
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from .config import RegistriesConfig, RegistryConfigError, RegistryHost
    from .errors import DigestMismatch, NoPlatform, NotFound, RegistryError, TooLarge, Unauthorized, Unreachable
    from .pulling import PullEvent, PullLimits, prune, pull, pull_sync, store_name
    from .reference import BadReference, Reference, parse


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
