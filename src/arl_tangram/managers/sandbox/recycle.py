"""Recycling one-shot sandboxes: a used sandbox is wiped, checked and put back in the warm pool.

Making a sandbox (bubblewrap, namespaces, an interpreter start) is most of a trivial one-shot's CPU
cost; a recycled one costs a reset request (~0.5 ms) instead. It is only acceptable if no one-shot
can influence a later one, so the runner's ``reset`` kills every process but itself and its zygote,
empties every writable place (``isolation.WRITABLE``), removes System V IPC objects and keyrings
(waiting until the keys it unlinked are destroyed: the kernel does that asynchronously, and
/proc/keys listed them to the next run for 10-20 ms), and checks that its own and the zygote's
rlimits, priority and affinity are as at start; anything it cannot verify makes the sandbox be
discarded, never reused. The runner is the namespace's init and non-dumpable, and python one-shots
fork from a zygote that never held a request (see ``inside/zygote.py``). Recycling is on only under
bubblewrap: there the user's code has no capabilities at all. Under ``unshare`` it is root of its
user namespace (it could ptrace the runner despite the dumpable flag) and under ``none`` there is
no namespace to reset, so those modes keep a fresh sandbox per one-shot.

Left as they are (low-bandwidth signals a later run could read, but nothing that changes what
a later program does unless it looks for them): the PID and tmpfs inode counters advance, and
timing. The kernel's keyrings are not namespaced, and every sandbox's user is the same host
user, so a key one sandbox added was listed, description and serial, in /proc/keys of every other
sandbox running at that time: a channel between concurrent runs that no reset closes. So the runner refuses ``add_key``, ``request_key`` and ``keyctl`` to
everything in its sandbox with a seccomp filter, as container runtimes' default profiles do
(``inside.reset.deny_keyrings``; the keyring clear above stays for a kernel or architecture where the
filter cannot be installed). A fresh user+mount+PID namespace per run inside the sandbox would
close those counters too, but needs capability dropping by hand in every child.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from typing import Awaitable, Callable

from .isolation import WRITABLE
from .sandbox import Sandbox, SandboxDied

log = logging.getLogger(__name__)


class Recycler:
    """Resets used one-shot sandboxes off the latency path and hands the clean ones to ``put``
    (which returns False when the pool is full); everything else is killed."""

    def __init__(self, enabled: bool, put: Callable[[Sandbox], bool], spawn: Callable[[Awaitable], object],
                 max_uses: int = 1000, timeout_s: float = 10.0, ahead: bool = True,
                 settled: Callable[[], None] = lambda: None, lost: Callable[[], None] = lambda: None) -> None:
        """``spawn`` runs a background coroutine that shutdown waits for (the manager's TaskSet);
        ``ahead``: the reset after a python run forks the next python child ahead (inside/zygote.py);
        ``settled``: called when a released sandbox's reset ended (it is in the pool, or not);
        ``lost``: called when a recyclable one released was discarded (worn out, unclean, dead),
        so that its place in circulation is filled (``pool.OneShots.lost``)."""
        self.enabled = enabled
        self.put = put
        self.spawn = spawn
        self.settled = settled
        self.lost = lost
        #: one-shot sandboxes being reset now: most are back in the pool within a millisecond
        self.resetting = 0
        self.max_uses = max_uses
        self._draw = random.Random()  # each sandbox's own use count (``limit``)
        self._worn = False  # whether a sandbox has worn out yet (``limit``'s first generation)
        self.timeout_s = timeout_s
        self.ahead = ahead
        self.recycled = 0
        self.discarded: Counter[str] = Counter()
        self.over_cap = 0  # reset clean but killed: the pool would not take it (at its idle cap, or closing)
        self.sessions_recycled = 0  # session sandboxes reused after their session left (session_verdict)
        self.sessions_discarded: Counter[str] = Counter()

    def release(self, sb: Sandbox) -> None:
        """A one-shot is done with ``sb`` (its result already reported)."""
        self.resetting += 1
        self.spawn(self._release(sb))

    async def _release(self, sb: Sandbox) -> None:
        try:
            reason = await self._verdict(sb)
            if reason is None:
                if self.put(sb):
                    self.recycled += 1
                    return
                self.over_cap += 1
        finally:
            self.resetting -= 1
            self.settled()
        if reason is not None:
            self.discarded[reason] += 1
            if reason.startswith("unclean"):
                log.warning("sandbox %s not recycled: %s", sb.id, reason)
            if self.circulates(sb):
                self.lost()
        await sb.kill()

    async def session_verdict(self, sb: Sandbox, prefork: bool = False) -> str | None:
        """A session has left ``sb`` (put to rest, or closed): None when it is verified pristine
        for another session, else why not. Only a default session's sandbox qualifies: its root is
        the host's, read-only, and its layered workspace has no layer under it (a fork's or a
        restore's would carry that session's files); an image's root may be written anywhere."""
        rootfs = sb.rootfs
        recyclable = rootfs is not None and rootfs.workspace_only and not rootfs.session_layers
        reason = await self._verdict(sb, recyclable, {"prefork": prefork})
        if reason is None:
            self.sessions_recycled += 1
        else:
            self.sessions_discarded[reason] += 1
            if reason.startswith("unclean"):
                log.warning("session sandbox %s not recycled: %s", sb.id, reason)
        return reason

    def riding(self, sb: Sandbox) -> dict | None:
        """The reset to send with a one-shot's last request (``Sandbox.request``'s ``then``), when
        ``release`` will ask ``sb`` for one: the runner then resets right after its answer, and the
        verdict reads that reset's answer instead of sending a request of its own."""
        return None if self._not_reset(sb) else self._reset()

    def circulates(self, sb: Sandbox) -> bool:
        """Whether a one-shot sandbox is reused from run to run, so that losing it leaves the pool
        one short (with recycling off, or an image's sandbox, each run takes a fresh one and the
        pool's refill keeps up as it is)."""
        return self.enabled and sb.recyclable

    def _not_reset(self, sb: Sandbox, recyclable: bool | None = None) -> str | None:
        """Why ``sb`` is not reset for reuse at all (None: it is)."""
        if not self.enabled:
            return "recycling off"
        if not (sb.recyclable if recyclable is None else recyclable):
            return "not recyclable"  # an image's sandbox: its root may be writable
        if sb.dead or sb.proc.returncode is not None:
            return "dead"
        if sb.uses + 1 >= self.limit(sb):
            self._worn = True
            return "worn out"
        return None

    def limit(self, sb: Sandbox) -> int:
        """How many one-shots ``sb`` runs before it is replaced: its own count, drawn once from the
        last tenth of ``max_uses`` (900-1,000 by default). With one count for all, the sandboxes
        a busy host keeps in circulation (they take turns from the top of the pool) would wear out
        together and be replaced at once (``pool.OneShots.lost``), a burst of starts of 10-50 ms
        of CPU each; drawn from the upper half, they would live a fifth shorter on average, and
        the extra starts cost more than the bursts.

        Until the first sandbox wears out, counts are drawn from the upper half: the sandboxes a
        server starts with (or makes as its load grows) are used at the same pace, so a tenth's
        spread would still wear most of them out within one stretch. Spread over half a life,
        their replacements come as spread, and each replacement's own count, drawn from the last
        tenth, keeps its place in that spread; the first generation's shorter lives cost a quarter
        of one generation's starts, once."""
        if sb.max_uses is None:
            low = self.max_uses - self.max_uses // 10 if self._worn else self.max_uses - self.max_uses // 2
            sb.max_uses = self._draw.randint(max(1, low), self.max_uses)
        return sb.max_uses

    def _reset(self, extra: dict | None = None) -> dict:
        return {"op": "reset", "dirs": WRITABLE, "ahead": self.ahead, **(extra or {})}

    async def _verdict(self, sb: Sandbox, recyclable: bool | None = None, extra: dict | None = None) -> str | None:
        """None when ``sb`` is verified pristine, else why not."""
        why = self._not_reset(sb, recyclable)
        if why is not None:
            return why
        try:
            if sb.then_pending and not extra:  # it rode on the run (``riding``): under way already
                r = await sb.then_answer(self.timeout_s)
            else:
                r = await sb.request(self._reset(extra), self.timeout_s)
        except SandboxDied as e:
            return f"unclean: reset failed ({e})"
        if not r.get("clean"):
            return f"unclean: {r.get('why') or r.get('error') or 'unknown'}"
        sb.uses += 1
        return None

    def stats(self) -> dict:
        return {"enabled": self.enabled, "recycled": self.recycled, "discarded": dict(self.discarded),
                "sessions_recycled": self.sessions_recycled, "sessions_discarded": dict(self.sessions_discarded)}
