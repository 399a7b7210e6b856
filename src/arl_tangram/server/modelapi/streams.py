"""Streamed generation in the engine process: a request's tokens as the decode loop chooses them.

A route opens a stream (``Calls.stream_open``: the request checked, counted and admitted as
``Calls.generate`` does it, then run in a task) and reads it (``Calls.stream_read``): the events
past the ones it has, waiting up to ``wait_s`` for one, and the answers once the batch has run.
A read is a long poll, one call and one answer, so it works the same through the fronts' link as
in process; the events a route reads together are the tokens made since its last read.

The decode loop hands a token to the request's ``on_token`` (``Streamed``) in its own thread;
the engine process's loop is woken only while a read waits for one. An event is ``(item, token,
text, logprob, top, pieces)``: the index of the request's prompt (or sample), the token, the text
it adds where that text is settled (the answer's text is the final word: a route sends what is
left of it at the end), its log-probability and top alternatives where asked, and those tokens'
own texts where asked (``Generate.pieces``). A request that leaves this process (a model on
another node of a Ray cluster) is pickled as the plain ``Generate``: its tokens come with the
answer, in one go.
"""

from __future__ import annotations

import asyncio
import collections
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


def _release(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Waker:
    """Wakes the engine process's loop for the reads whose streams got a token, once for a burst:
    the decode loop hands every row of a step its token one after the other, and the loop is
    woken once for all of them (a wake is a write to its self-pipe and a pass of the loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._due: collections.deque[asyncio.Future] = collections.deque()
        self._scheduled = False

    def wake(self, waiter: asyncio.Future) -> None:
        """Release ``waiter`` in the loop (called from any thread)."""
        self._due.append(waiter)  # first: a flush that began before this line releases it, or
        if not self._scheduled:  # the next one does, which this schedules
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        while self._due:
            _release(self._due.popleft())


class Stream:
    """One request's events and, once it ran, its answers (or the error it ended with)."""

    def __init__(self, waker: Waker, model: str) -> None:
        self.waker, self.loop, self.model = waker, waker.loop, model
        self.events: list[tuple] = []
        self.done = False
        self.answers: list | None = None
        self.error: BaseException | None = None
        self.task: asyncio.Task | None = None
        self.read_at = time.monotonic()
        self._waiter: asyncio.Future | None = None  # the read waiting for an event, if one is

    def sink(self, item: int) -> Callable[..., None]:
        """The ``on_token`` of the request's ``item``-th prompt (called in the decode loop's thread)."""
        events, waker = self.events, self.waker

        def on_token(token: int, text: str, logprob: float | None, top: Any, pieces: Any) -> None:
            events.append((item, token, text, logprob, top, pieces))  # first: a read tests the events after
            waiter = self._waiter  # it publishes its waiter
            if waiter is not None:  # a read waits: wake it (the loop is woken only then)
                self._waiter = None
                waker.wake(waiter)

        return on_token

    def finish(self, answers: list | None = None, error: BaseException | None = None) -> None:
        self.answers, self.error, self.done = answers, error, True
        if self._waiter is not None:
            _release(self._waiter)

    async def read(self, sent: int, wait_s: float) -> dict:
        """The events past the first ``sent``; waits up to ``wait_s`` while there are none and
        the request runs. Once it ran: ``done``, and its answers (or its error, raised)."""
        self.read_at = time.monotonic()
        if len(self.events) <= sent and not self.done:
            waiter = self._waiter = self.loop.create_future()
            if len(self.events) <= sent and not self.done:  # an event between the test and the waiter
                timer = self.loop.call_later(wait_s, _release, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
            self._waiter = None
        self.read_at = time.monotonic()
        done = self.done  # before the events: once done, the decode loop appends no more
        events = self.events[sent:]
        if done and self.error is not None:
            raise self.error
        return {"events": events, "done": done, "model": self.model, "answers": self.answers if done else None}
