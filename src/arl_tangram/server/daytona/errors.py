"""Errors in Daytona's shape, as its SDK reads them.

The SDK turns an HTTP error into a ``DaytonaError`` subclass by the pair (``source``, ``code``)
when it knows the pair (the toolbox's ``FILE_NOT_FOUND`` is a ``DaytonaFileNotFoundError``), else
by the HTTP status (404: ``DaytonaNotFoundError``). So every error of the dialect carries its
status, a code and the side that answered: ``DAYTONA_API`` for the control plane, ``DAYTONA_DAEMON``
for a sandbox's toolbox.
"""

from __future__ import annotations

import datetime
from http import HTTPStatus

API = "DAYTONA_API"
DAEMON = "DAYTONA_DAEMON"

#: the code an error of a status carries when it names none of its own
CODE_OF_STATUS = {400: "BAD_REQUEST", 401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND", 408: "REQUEST_TIMEOUT",
                  409: "CONFLICT", 410: "GONE", 413: "BAD_REQUEST", 422: "UNPROCESSABLE_ENTITY",
                  429: "TOO_MANY_REQUESTS", 501: "NOT_IMPLEMENTED", 503: "SERVICE_UNAVAILABLE"}


class DaytonaApiError(Exception):
    """An error of the Daytona dialect: ``status`` for HTTP, ``code`` Daytona's name for it,
    ``source`` the side that answers (the control plane or the sandbox's daemon)."""

    def __init__(self, status: int, message: str, code: str | None = None, source: str = API) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code or CODE_OF_STATUS.get(status, "INTERNAL_SERVER_ERROR")
        self.source = source

    def __reduce__(self):  # crosses the front link (link.py) as itself
        return DaytonaApiError, (self.status, self.message, self.code, self.source)

    def body(self, path: str = "", method: str = "") -> dict:
        return shape(self.status, self.message, self.code, self.source, path, method)


def shape(status: int, message: str, code: str | None = None, source: str = API, path: str = "",
          method: str = "") -> dict:
    """Daytona's error body: the control plane's ``{statusCode, message, error}`` and the
    toolbox's ``ErrorResponse`` fields (``code``, ``source``, ``path``, ``method``,
    ``timestamp``) in one."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    return {"statusCode": status, "message": message, "error": phrase,
            "code": code or CODE_OF_STATUS.get(status, "INTERNAL_SERVER_ERROR"), "source": source,
            "path": path, "method": method, "timestamp": now}


def daemon(status: int, message: str, code: str | None = None) -> DaytonaApiError:
    """An error of a sandbox's toolbox (the SDK maps its daemon codes to precise classes)."""
    return DaytonaApiError(status, message, code, DAEMON)
