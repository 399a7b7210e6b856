"""Python clients for ``tangram serve``: ``TangramClient`` (sync) and ``AsyncTangramClient``
(async) offer one method set (``base.Methods``/``base.SessionMethods``) and differ only in how a
request is sent and a retry waited for.

Every submission carries an id (generated when not given), so a retried request can never run an
action twice. 429 is retried honouring Retry-After; transport errors and 5xx are retried when the
request is idempotent (everything but a session's ``exec``, which is re-sent only if it never
left); an ``infra_error`` outcome of a one-shot run is re-run under a derived id, because it is
ours and not the code's. A session step that ends in ``infra_error`` is returned, not retried: its
state may be gone and only the caller knows what to redo.
"""

from .aio import AsyncSession, AsyncTangramClient
from .base import Request, RetryPolicy, RunOptions, TangramError
from .sync import Session, TangramClient

__all__ = ["AsyncSession", "AsyncTangramClient", "Request", "RetryPolicy", "RunOptions", "Session", "TangramClient",
           "TangramError"]
