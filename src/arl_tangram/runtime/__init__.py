"""Runtimes drive the engine with a real clock and real managers (local: asyncio, in-process)."""

from .local import ActionResult, LocalRuntime, Session, Tangram

__all__ = ["ActionResult", "LocalRuntime", "Session", "Tangram"]
