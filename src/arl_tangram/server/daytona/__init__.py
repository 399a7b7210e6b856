"""The Daytona dialect: Daytona's official SDK (``daytona``, sync and async) against
``tangram serve``.

A Daytona sandbox is a Tangram session, as an E2B sandbox is. ``routes.py`` speaks Daytona's wire
protocols (the control plane's REST under ``/api``, each sandbox's toolbox under
``/api/toolbox/{id}``, the streamed logs and the event connection as WebSockets: ``socketio.py``,
the upload and download forms: ``forms.py``); the translation onto ``Service`` in the engine
process is ``sandboxes.py`` (the control plane, snapshots, events), ``process.py``, ``files.py``
and ``git.py``. What is supported and what differs: docs/daytona.md.
"""

from ..dialect import Dialect
from . import files, git, process, sandboxes
from .errors import DaytonaApiError, shape
from .routes import is_daytona, routes

DIALECT = Dialect("daytona", {**sandboxes.CALLS, **process.CALLS, **files.CALLS, **git.CALLS}, routes,
                  claims=is_daytona,  # the SDK reads {statusCode, message, code, source}, routing errors included
                  error=lambda status, message: shape(status, message),
                  relayed=(DaytonaApiError,))

__all__ = ["DIALECT", "DaytonaApiError", "is_daytona"]
