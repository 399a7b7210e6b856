"""Names that become paths, checked where they enter (HTTP schemas, the Python API, the CLI).

A name a client sends ends up in a file-system call somewhere: an image name picks a file in the
image store, a file name is written or read inside a sandbox. A NUL byte there is a ``ValueError``
deep inside ``os``, which surfaced as a 500 ("internal error: ValueError") or as a run that
``Failed`` with no record of why. So every such name is checked once, at the edge, with a message
naming the field; what passes can reach a path safely.
"""

from __future__ import annotations

import re

#: image names: a letter or digit first, then letters, digits and ``._:@/-`` (``library/python:3.12``)
IMAGE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$"
IMAGE_NAME_RE = re.compile(IMAGE_NAME)

#: Linux's limits: a whole path, one component
MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255


def path_problem(path: object) -> str | None:
    """Why ``path`` cannot name a file in a sandbox (None if it can). Relative paths are taken in
    the sandbox's workspace and absolute ones inside its root: where they may go is the sandbox's
    business; here only what no file system accepts is refused."""
    if not isinstance(path, str):
        return f"file name {path!r} is not a string"
    if not path:
        return "empty file name"
    if "\x00" in path:
        return f"file name {path!r} contains a NUL byte"
    encoded = path.encode("utf-8", "surrogateescape")
    if len(encoded) > MAX_PATH_BYTES:
        return f"file name of {len(encoded)} bytes is longer than {MAX_PATH_BYTES}"
    if any(len(part) > MAX_COMPONENT_BYTES for part in encoded.split(b"/")):
        return f"file name {path[:60]!r}... has a component longer than {MAX_COMPONENT_BYTES} bytes"
    return None


def check_paths(paths):
    """A pydantic after-validator for a list of file names or a dict keyed by them."""
    for p in paths:
        problem = path_problem(p)
        if problem:
            raise ValueError(problem)
    return paths


def check_text(text):
    """A pydantic after-validator for program text and stdin: JSON may carry a lone surrogate
    (``"\\ud800"``), which no UTF-8 file or pipe can hold: unchecked, it is a 500 when the request
    is journaled (``PydanticSerializationError``); checked, a 422 naming the field."""
    if text is None:
        return text
    try:
        (text if isinstance(text, str) else "".join(text)).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid UTF-8 text: a lone surrogate at character {e.start}") from None
    return text


#: the largest memory limit a request may ask for, in MB (16 TiB): past 2**63 bytes the limit
#: overflowed in the sandbox's ``setrlimit`` and a correct program "failed" with that error
MAX_MEMORY_MB = 1 << 24


def image_problem(name: object) -> str | None:
    """Why ``name`` is not an image name (None if it is)."""
    if isinstance(name, str) and IMAGE_NAME_RE.match(name):
        return None
    return f"{name!r} is not a valid image name (a letter or digit, then letters, digits and ._:@/-, 128 at most)"
