"""The E2B dialect: E2B's official SDKs (``e2b``, ``e2b-code-interpreter``) against ``tangram serve``.

An E2B sandbox is a Tangram session. ``routes.py`` speaks E2B's wire protocols (REST, envd's
Connect-RPC over ``envelope.py``, the code interpreter's NDJSON); the translation onto ``Service``
in the engine process is ``sandboxes.py`` (the sandboxes and the control plane),
``processes.py``, ``files.py`` (with ``fsops.py``: the filesystem calls, carried out by the
sandbox's agent) and ``interpreter.py``. What is supported and what differs: README, "E2B clients".
"""

from ..dialect import Dialect
from .envelope import E2bError
from . import files, interpreter, processes, sandboxes
from .routes import is_e2b, routes

DIALECT = Dialect("e2b", {**sandboxes.CALLS, **processes.CALLS, **files.CALLS, **interpreter.CALLS}, routes,
                  key_header="x-api-key",  # the SDKs send E2B_API_KEY as X-API-KEY
                  claims=is_e2b,  # E2B's clients parse {"code": int, "message"}, routing errors included
                  error=lambda status, message: {"code": status, "message": message},
                  relayed=(E2bError,))

__all__ = ["DIALECT", "E2bError", "is_e2b"]
