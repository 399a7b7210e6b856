"""A running shell step's stdin, fed while the step runs (E2B's ``send_stdin``/``close_stdin``).

Without it a step's stdin is whole: given with the step, so a command that waits for its input
(``cat``, a REPL, ``read line``) can only be started once all of it is known. A ``LiveStdin``
is handed to ``Session.exec``; what is ``send``-ed before the step holds the sandbox is kept, and
from then on goes straight to the sandbox's runner, which writes it into the step's stdin (a FIFO,
``inside/shellio.py``) as the step reads; ``close`` is its end of file. A step that has ended takes no
more input (``StdinClosed``), as a pipe whose reader is gone.

Bounded both ways, losing nothing silently: what waits for the step to start, and what waits in
the host's channel to the runner (the runner holds at most ``shell.STDIN_HELD`` unread bytes,
then stops reading the channel), are each capped at ``UNSENT_MAX``; past it ``send`` raises
``StdinFull`` and takes none of the data (the caller sends it again once the step has read).
"""

from __future__ import annotations

from typing import Protocol

#: input accepted for a step and not yet taken by its sandbox
UNSENT_MAX = 16 << 20


class StdinClosed(Exception):
    """The step's stdin is closed, or the step has ended: input is no longer taken."""


class StdinFull(Exception):
    """``UNSENT_MAX`` bytes already wait for the step to read them: none of this input was taken."""


class Sink(Protocol):
    """Writes one piece of input (and whether it is the end) to the step's sandbox; raises
    ``StdinFull`` (nothing written) or ``StdinClosed``. ``checked=False``: input already taken
    under the cap (what was kept before the step started), written whatever waits."""

    def __call__(self, data: bytes, eof: bool, checked: bool = True) -> None: ...


class LiveStdin:
    """One step's stdin, fed while it runs (see the module's docstring). Used on one event loop."""

    def __init__(self) -> None:
        self._pending = bytearray()
        self._eof = False
        self._over = False
        self._sink: Sink | None = None

    @property
    def closed(self) -> bool:
        return self._eof or self._over

    def send(self, data: bytes) -> None:
        """Give the step ``data`` (in order with what came before)."""
        if self._over:
            raise StdinClosed("the command has ended: its stdin takes no more input")
        if self._eof:
            raise StdinClosed("its stdin was closed")
        if not data:
            return
        if self._sink is not None:
            self._sink(bytes(data), False)
            return
        if len(self._pending) + len(data) > UNSENT_MAX:
            raise StdinFull(f"{len(self._pending)} bytes of stdin already wait for the command to start "
                            f"(at most {UNSENT_MAX}): send the rest once it reads")
        self._pending += data

    def close(self) -> None:
        """End of file for the step (once it has read what was sent); closing again is nothing."""
        if self.closed:
            return
        self._eof = True
        if self._sink is not None:
            self._sink(b"", True)

    def bind(self, sink: Sink) -> None:
        """The step holds its sandbox and its request is written: what was kept goes now, and
        every later ``send`` straight through ``sink``."""
        if self._over:
            return
        self._sink = sink
        if self._pending or self._eof:
            data, self._pending = bytes(self._pending), bytearray()
            sink(data, self._eof, checked=False)

    def end(self) -> None:
        """The step has ended: later input is refused, kept input dropped."""
        self._over = True
        self._sink = None
        self._pending = bytearray()
