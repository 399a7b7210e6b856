"""Which registries a pull talks to and how: ``[[registries]]`` tables of the server config.

```toml
[[registries]]
host = "docker.io"
mirrors = ["127.0.0.1:5001"]      # tried first, in order; the origin after them

[[registries]]
host = "127.0.0.1:5001"
insecure = true                   # plain HTTP (no TLS) to this host, and only to hosts named so

[[registries]]
host = "ghcr.io"
username = "me"
password = "ghp_..."
```

A mirror is a host of its own: it speaks plain HTTP only if a table names it insecure, and
its credentials are its own table's. Credentials not given here are taken from Docker's
``config.json`` (``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``), its ``auths``
section; credential helpers are not run.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..images import ImageError
from .reference import BadReference, normalise_host


class RegistryConfigError(ImageError):
    """A ``[[registries]]`` table that is not valid; the message names the field."""


def _mirror_host(text: str) -> str:
    """``host[:port]`` or ``https://host[:port]`` (as Docker's registry-mirrors write it): the host.
    ``http://`` is refused: plain HTTP is a property of the mirror's own table (``insecure``)."""
    if text.startswith("http://"):
        raise ValueError(f"mirror {text!r}: give the host alone and a [[registries]] table for it with "
                         "insecure = true (plain HTTP is only for hosts named insecure)")
    host = text.removeprefix("https://").rstrip("/")
    if "/" in host:
        raise ValueError(f"mirror {text!r}: a host or host:port (a path after it is not supported)")
    return host


class RegistryHost(BaseModel):
    """One registry host: how to reach it, its mirrors, its credentials."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(..., min_length=1, description="the registry as references name it: docker.io, ghcr.io, "
                      "127.0.0.1:5000")
    insecure: bool = Field(False, description="plain HTTP to this host (no TLS); only for registries you trust "
                           "on the path, such as one on loopback")
    mirrors: list[str] = Field(default_factory=list, description="hosts serving the same repositories, tried "
                               "first in order; the origin after them (as Docker's registry-mirrors)")
    username: str | None = Field(None, min_length=1, description="basic credentials for this host (or its "
                                 "token service)")
    password: str | None = Field(None, description="with username")

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        try:
            return normalise_host(v, "host")
        except BadReference as e:
            raise ValueError(str(e).removeprefix("host: ")) from None

    @field_validator("mirrors")
    @classmethod
    def _mirrors(cls, v: list[str]) -> list[str]:
        out = []
        for m in v:
            host = _mirror_host(m)
            try:
                out.append(normalise_host(host, "mirror"))
            except BadReference as e:
                raise ValueError(str(e)) from None
        return out

    @model_validator(mode="after")
    def _pair(self) -> "RegistryHost":
        if (self.username is None) != (self.password is None):
            raise ValueError(f"registry {self.host!r}: give username and password together")
        if self.host in self.mirrors:
            raise ValueError(f"registry {self.host!r}: is its own mirror")
        return self


class RegistriesConfig(BaseModel):
    """Every ``[[registries]]`` table, and where Docker's credentials are read from."""

    model_config = ConfigDict(extra="forbid")

    registries: list[RegistryHost] = Field(default_factory=list)
    docker_config: Path | None = Field(None, description="Docker's config.json for credentials (default: "
                                       "$DOCKER_CONFIG/config.json, else ~/.docker/config.json)")

    @field_validator("registries")
    @classmethod
    def _distinct(cls, v: list[RegistryHost]) -> list[RegistryHost]:
        seen = set()
        for r in v:
            if r.host in seen:
                raise ValueError(f"host {r.host!r} has two tables")
            seen.add(r.host)
        return v

    @classmethod
    def from_toml(cls, data: dict) -> "RegistriesConfig":
        """The registries of a parsed config file (its ``registries`` key; the rest is ignored).
        ``RegistryConfigError`` names the field: ``registries.0.host: ...``."""
        if not isinstance(data, dict):
            raise RegistryConfigError("registries: the config is not a table")
        raw = {"registries": data.get("registries", [])}
        if "docker_config" in data:
            raw["docker_config"] = data["docker_config"]
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"]))
            msg = str(err["msg"]).removeprefix("Value error, ")
            raise RegistryConfigError(f"{where}: {msg}") from None

    def host(self, host: str) -> RegistryHost:
        """The table for ``host`` (a default one where the config has none)."""
        for r in self.registries:
            if r.host == host:
                return r
        return RegistryHost(host=host)

    def credentials(self, host: str) -> tuple[str, str] | None:
        """(username, password) for ``host``: its table's, else Docker's config.json's, else None."""
        r = self.host(host)
        if r.username is not None:
            return r.username, r.password or ""
        return docker_credentials(host, self.docker_config)


def _docker_config_path(given: Path | None) -> Path:
    if given is not None:
        return given
    base = os.environ.get("DOCKER_CONFIG")
    return Path(base) / "config.json" if base else Path.home() / ".docker" / "config.json"


def docker_credentials(host: str, path: Path | None = None) -> tuple[str, str] | None:
    """Credentials for ``host`` from Docker's ``config.json`` ``auths`` (keys such as
    ``https://index.docker.io/v1/``, ``ghcr.io``, ``127.0.0.1:5000``); None if it has none. A
    file that cannot be read or parsed counts as none (Docker itself is not needed here)."""
    try:
        data = json.loads(_docker_config_path(path).read_text())
    except (OSError, ValueError):
        return None
    auths = data.get("auths") if isinstance(data, dict) else None
    if not isinstance(auths, dict):
        return None
    for key, entry in auths.items():
        if not isinstance(entry, dict) or _auth_key_host(key) != host:
            continue
        if entry.get("auth"):
            try:
                user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                continue
            if sep:
                return user, password
        if entry.get("username") and entry.get("password") is not None:
            return str(entry["username"]), str(entry["password"])
    return None


def _auth_key_host(key: str) -> str | None:
    text = key
    for prefix in ("https://", "http://"):
        text = text.removeprefix(prefix)
    text = text.split("/", 1)[0]
    try:
        return normalise_host(text, "auths")
    except BadReference:
        return None


__all__ = ["RegistriesConfig", "RegistryConfigError", "RegistryHost", "docker_credentials"]
