"""Streamed generation in the engine process: a request's tokens as the decode loop chooses them.

A route opens a stream (``Calls.stream_open``: the request checked, counted and admitted as
``Calls.generate`` does it, then run in a task) and reads it (``Calls.stream_read``): the events
past the ones it has, waiting up to ``wait_s`` for one, and the answers once the batch has run.
A read is a long poll, one call and one answer, so it works the same through the fronts' link as
in process; the events a route reads together are the tokens made since its last read.

The decode loop hands a token to the request's ``on_token`` (``Streamed``) in its own thread;
the engine process's loop is woken only while a read is waiting. An event is ``(item, token,
text, logprob, top, pieces)``: the index of the request's prompt (or sample), the token, the text
it adds where that text is settled (the answer's text is the final word: a route sends what is
left of it at the end), its log-probability and top alternatives where asked, and those tokens'
own texts where asked (``Generate.pieces``). A request that leaves this process (a model on
another node of a Ray cluster) is pickled as the plain ``Generate``: its tokens come with the
answer, in one go.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from ...managers.models.generation import Generate

#: a stream nobody read for this long is dropped (its client went away)
UNREAD_S = 120.0


def _plain(fields: dict) -> Generate:
    g = Generate.__new__(Generate)
    g.__dict__.update(fields)
    return g


class Streamed(Generate):
    """A ``Generate`` whose tokens go to ``on_token(token, text, logprob, top, pieces)`` as they
    are chosen (in this process; pickled, it is the plain request)."""

    def __init__(self, base: Generate, on_token: Callable[..., None]) -> None:  # noqa: D107 - the base's fields
        self.__dict__.update(base.__dict__)
        self.on_token = on_token

    def __reduce__(self):
        return _plain, ({k: v for k, v in self.__dict__.items() if k != "on_token"},)


class Stream:
    """One request's events and, once it ran, its answers (or the error it ended with)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, model: str) -> None:
        self.loop, self.model = loop, model
        self.events: list[tuple] = []
        self.done = False
        self.answers: list | None = None
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.read_at = time.monotonic()
        self._wake = asyncio.Event()
        self._waiting = False

    def sink(self, item: int) -> Callable[..., None]:
        """The ``on_token`` of the request's ``item``-th prompt (called in the decode loop's thread)."""
        events, loop = self.events, self.loop

        def on_token(token: int, text: str, logprob: float | None, top: Any, pieces: Any) -> None:
            events.append((item, token, text, logprob, top, pieces))
            if self._waiting:  # a read waits: wake it (a list append needs no lock)
                self._waiting = False
                loop.call_soon_threadsafe(self._wake.set)

        return on_token

    def finish(self, answers: list | None = None, error: BaseException | None = None) -> None:
        self.answers, self.error, self.done = answers, error, True
        self._wake.set()

    async def read(self, sent: int, wait_s: float) -> dict:
        """The events past the first ``sent``; waits up to ``wait_s`` while there are none and
        the request runs. Once it ran: ``done``, and its answers (or its error, raised)."""
        self.read_at = time.monotonic()
        if len(self.events) <= sent and not self.done:
            self._wake.clear()
            self._waiting = True
            if len(self.events) <= sent and not self.done:  # an event between the test and the flag
                try:
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                except asyncio.TimeoutError:
                    pass
            self._waiting = False
        self.read_at = time.monotonic()
        done = self.done  # before the events: once done, the decode loop appends no more
        events = self.events[sent:]
        if done and self.error is not None:
            raise self.error
        return {"events": events, "done": done, "model": self.model, "answers": self.answers if done else None}
