"""Runtimes drive the engine with a real clock and real managers: ``local`` (asyncio, this
machine) behind the embedded API of ``api`` (``Tangram``, ``Session``)."""

from .api import Session, Tangram
from .base import ActionResult, NoRoom, Runtime, SessionGone, Snapshot
from .host import LocalHost
from .local import LocalRuntime

__all__ = ["ActionResult", "LocalHost", "LocalRuntime", "NoRoom", "Runtime", "Session", "SessionGone", "Snapshot", "Tangram"]
