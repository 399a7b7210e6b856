"""The life of one action in the sandbox manager: its sandbox found, placed, run, accounted, let go.

A one-shot takes a sandbox from the pool (``pool.py``) and gives it to the recycler after its
report; a session's step uses its session's sandbox, waking it from rest (``resting.py``) or
starting a pending root's processes first, and freezes it after. A new sandbox of an image not
on this node waits for the image's pull first (``pulls.py``), within the action. The sandbox is pinned to the
allocation's cores (cpuset) or, for a one-shot sharing the host's CPUs, bounded to their worth of
CPU time (``OneShots.placement``), and limited to its memory; the payload runs through
``execution.py``'s table.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from ...core.action import Action, Allocation, Outcome, Setup
from ...core.seam import Completion
from .corewaits import CoreWaits
from .execution import Execution, Step, join, outcome_of, result_of
from .host import SandboxHost
from .images import ImageError
from .lease import Lease, Unanswered
from .livestdin import LiveStdin
from .pool import OneShots
from .pulls import Pulls
from .resting import Resting
from .sandbox import Sandbox, SandboxDied
from .sessionpool import SessionPool
from .sessions import SessionBook
from .spec import Exec, RunCode, SandboxResult

log = logging.getLogger(__name__)


class Runs:
    """Runs the actions the engine starts here and reports each one's ``Completion``."""

    def __init__(self, host: SandboxHost, lease: Lease, pool: OneShots, spares: SessionPool, book: SessionBook,
                 resting: Resting, execution: Execution, pulls: Pulls) -> None:
        self.host, self.lease, self.pool, self.spares = host, lease, pool, spares
        self.book, self.resting, self.execution, self.pulls = book, resting, execution, pulls
        #: running actions -> [their sandbox once it is pinned (None before), the cores they may
        #: use]: registered at ``start`` so that a ``resize`` before the run is pinned is not lost
        self.pins: dict[str, list] = {}
        self.listeners: dict[str, Callable[[str, bytes], None]] = {}  # streamed steps (``listen``)
        self.stdins: dict[str, LiveStdin] = {}  # shell steps with a live stdin (``feed``)
        self.core_waits = CoreWaits()  # each core's wait between two one-shots (``/healthz`` core_waits)

    def start(self, action: Action, allocation: Allocation, after: str | None = None) -> None:
        """(``SandboxManager.start``.)"""
        mine = self.lease.join(action.id, after)
        self.pins[action.id] = [None, self.host.cores(allocation)]
        tasks = self.host.tasks
        tasks.run(action, lambda: self._run_pinned(action, allocation, mine))
        # ended in any way, a task cancelled before it ran included: what follows it is not held up for good
        tasks.actions[action.id].add_done_callback(lambda _: self.lease.over(action.id, mine))

    async def _run_pinned(self, action: Action, allocation: Allocation, mine: Unanswered) -> Completion:
        try:
            return await self.run(action, allocation, mine)
        finally:
            self.pins.pop(action.id, None)

    def cancel(self, action_id: str) -> None:
        self.pins.pop(action_id, None)  # a task cancelled before it ran never reaches its ``finally``
        self.lease.cancel(action_id)
        self.host.tasks.cancel(action_id)

    def resize(self, action_id: str, allocation: Allocation) -> None:
        """(``SandboxManager.resize``.)"""
        pin = self.pins.get(action_id)
        if pin is None:
            return  # ended, or not ours
        cores = self.host.cores(allocation)
        pin[1] = cores
        sb = pin[0]
        if sb is not None and not sb.dead:
            try:  # a one-shot sharing the host's CPUs keeps sharing them, with a smaller quota
                sb.set_cpus(*self.pool.placement(cores, sb.cpu_quota is not None))
            except OSError as e:
                # the group is gone (the sandbox died), or would not take the write: the run must
                # not go on using the cores taken back, so it ends as an infrastructure failure
                log.warning("cannot bound sandbox %s to cores %s: %s; killing it", sb.id, cores, e)
                self.host.kill_later(sb)

    def listen(self, action_id: str, on_output: Callable[[str, bytes], None]) -> Callable[[], None]:
        """(``SandboxManager.listen``.)"""
        cap = self.host.config.max_output_bytes
        seen = {"stdout": 0, "stderr": 0}

        def capped(stream: str, data: bytes) -> None:  # the runner caps too; this holds if it lies
            room = cap - seen[stream]
            if room > 0:
                seen[stream] += min(room, len(data))
                try:
                    on_output(stream, data[:room])
                except Exception:  # the listener's bug: it hears no more, the step runs on
                    log.exception("output listener of %s failed: it is dropped", action_id)
                    seen[stream] = seen["stdout"] = seen["stderr"] = cap

        def stop() -> None:
            self.listeners.pop(action_id, None)

        self.listeners[action_id] = capped
        return stop

    def feed(self, action_id: str, stdin: LiveStdin) -> Callable[[], None]:
        """(``SandboxManager.feed``.)"""

        def stop() -> None:
            self.stdins.pop(action_id, None)

        self.stdins[action_id] = stdin
        return stop

    async def run(self, action: Action, allocation: Allocation, mine: Unanswered | None = None) -> Completion:
        host, book, config = self.host, self.book, self.host.config
        t0 = time.monotonic()
        direct = self.execution.direct.get(type(action.payload))
        if direct is not None:  # a root to mount, no sandbox to start
            outcome, result = await direct(action)
            return Completion(action.id, outcome, 0.0, time.monotonic() - t0, result.message, result)
        pin = self.pins.get(action.id) or [None, host.cores(allocation)]
        cores = pin[1]
        payload = action.payload
        sb = None
        message = ""
        image = getattr(payload, "image", None) or config.image
        woke: dict[str, str] | None = None
        answer: dict | None = None  # the step's cell, run by the wake's last request
        traj = action.trajectory
        if traj is not None:
            book.using.add(traj)
            if traj not in book.awake and len(book.awake) >= config.max_awake_sessions:
                # it is about to be awake (a wake, or a new session): the least recently used goes to
                # rest now, alongside the wake, rather than after the step, when its pack and reset
                # would compete with the answer and the next request for the cores
                self.resting.want()
        try:
            if image is not None and (traj is None or traj not in book.awake or book.awake[traj].dead):
                # a new sandbox of it: the image pulled first where it is not here (``pulls.py``)
                image = await self.pulls.ready(image, action.id)
            if traj is None:
                sb = await self.pool.take(image, self.pool.placement(cores, True)[0])
            else:
                while traj in book.moving:  # being put to rest: wake it once it is
                    await asyncio.shield(book.moving[traj])
                sb = book.awake.get(traj)
                if sb is None or sb.dead:
                    pending = book.pending.pop(traj, None)
                    rested = book.rested.pop(traj, None)
                    if rested is not None:
                        sb, woke, answer = await self.resting.wake(traj, rested, image, pin[1],
                                                                   self._cell_for_wake(action, pin))
                    elif pending is not None:  # a fork child or a restored session: its files are there
                        sb = await host.imageboxes.spawn(pending.image.name, rootfs=pending)
                    else:
                        if allocation.setup not in (Setup.CREATE, Setup.NONE):
                            message = "session restarted: its sandbox had been closed or killed, state was lost"
                        sb = await self.spares.take(image)
                    book.awake[traj] = sb
                sb.thaw()
            cores = pin[1]  # a resize may have come while the sandbox was prepared
            sb.set_cpus(*self.pool.placement(cores, traj is None))
            pin[0] = sb
            memory_mb = getattr(payload, "memory_mb", None)
            sb.set_memory((memory_mb or config.memory_mb) << 20)
            setup_s = time.monotonic() - t0
            oom_before = sb.oom_seen  # read after the sandbox's last action
            if answer is not None:  # its cell ran within the wake: OOM counted from before it, its time is exec time
                oom_before = pin[2] if len(pin) > 2 else oom_before
                ran = answer.get("duration_s")
                if isinstance(ran, (int, float)) and 0 <= ran <= setup_s:
                    setup_s -= ran
            t1 = time.monotonic()
            sb.first_written_at = 0.0  # set by this run's first request (``core_waits``)
            host.busy.add(sb)
            try:
                if answer is not None:
                    outcome, result = outcome_of(answer), result_of(answer)
                    await self.execution.drop_broken(sb, answer)
                else:
                    # a one-shot's reset rides on its run; not under a memory limit of its own below the
                    # default, where the reset's fork ahead could be killed before its OOM count is read
                    riding = (host.recycler.riding(sb) if traj is None and isinstance(payload, RunCode)
                              and (memory_mb or config.memory_mb) >= config.memory_mb else None)
                    step = Step(cores, self.listeners.get(action.id), mine.turn if mine is not None else None,
                                riding, self.stdins.get(action.id))
                    outcome, result = await self.execution.execute(sb, payload, step)
                    if mine is not None:  # the follower's turn, before this run's bookkeeping and report
                        self.lease.over(action.id, mine)
                    if traj is None and isinstance(payload, RunCode) and sb.first_written_at:
                        self.core_waits.ran(cores, sb.first_written_at, sb.answered_at)
            finally:
                host.busy.discard(sb)
            exec_s = time.monotonic() - t1
            if answer is not None and isinstance(answer.get("duration_s"), (int, float)):
                exec_s += max(0.0, float(answer["duration_s"]))
            if not sb.dead and sb.oom_kills() > oom_before and outcome is not Outcome.TIMEOUT:
                outcome = Outcome.OOM
                result.message = join(result.message, "killed: out of memory "
                                                      f"(limit {(memory_mb or config.memory_mb)} MB)")
        except SandboxDied as e:
            self._ended_unanswered(traj, sb, cores)
            outcome, result = self._died(e, action)
            setup_s, exec_s = time.monotonic() - t0, 0.0
        except ImageError as e:  # an unknown image, or images unsupported here: the request's problem
            # (but a registry that does not answer is not)
            outcome, result = Outcome.INFRA_ERROR if e.infra else Outcome.REJECTED, SandboxResult(message=str(e))
            setup_s, exec_s = time.monotonic() - t0, 0.0
        except asyncio.CancelledError:
            self._ended_unanswered(traj, sb, cores)
            if sb is not None:
                if (mine is not None and mine.turn is not None and not mine.turn.opened and sb.recyclable
                        and self.pool.put_back(sb)):
                    self.pool.settled()
                    raise  # cancelled while it waited for its turn: nothing ran in it
                await self.pool.kill_unreset(sb, traj)
            raise
        except Exception:
            if sb is not None:
                await self.pool.kill_unreset(sb, traj)
            raise  # the task set reports it as infra_error
        finally:
            if traj is not None:
                book.using.discard(traj)
        if woke is not None:
            result.info = {**result.info, "woken": True, "dropped": woke}
            if woke:
                message = join(message, "woken from rest without: " + "; ".join(f"{k} ({v})" for k, v in woke.items()))
        result.message = join(message, result.message)
        session_mem_gb = None
        if sb is not None and not sb.dead and traj is not None:
            sb.freeze()
            book.last_used[traj] = time.monotonic()
            session_mem_gb = self._idle_memory_gb(sb)
            if len(book.awake) > config.max_awake_sessions:
                self.resting.want()
        if sb is not None and traj is None:
            # starts once this task has reported: reset or teardown is not part of the action's ACT
            host.recycler.release(sb)
        return Completion(action.id, outcome, setup_s, exec_s, result.message, result, session_mem_gb)

    def _cell_for_wake(self, action: Action, pin: list) -> Callable[[Sandbox], dict | None] | None:
        """The request of a python step (no listener) that wakes its session, to ride on the wake's
        last request: one round trip host - runner - interpreter fewer. Streamed steps, shell steps
        and files keep their own request. The sandbox is pinned and limited before (a resize that
        comes while the cell runs applies from the next step)."""
        p = action.payload
        if not isinstance(p, Exec) or p.python is None or action.id in self.listeners:
            return None

        def cell(sb: Sandbox) -> dict:
            cores = pin[1]
            del pin[2:]
            pin.append(sb.oom_seen)  # what the step's OOM check counts from
            sb.set_cpus(cores)
            sb.set_memory((p.memory_mb or self.host.config.memory_mb) << 20)
            return {**self.execution.cell_request(cores, sb, p), "_timeout": p.timeout_s + self.host.config.grace_s + 1.0}

        return cell

    def _ended_unanswered(self, traj: str | None, sb: Sandbox | None, cores: tuple[int, ...]) -> None:
        """A one-shot that wrote its request ended with no answer (killed, cancelled): each core's
        next wait counts from now (``core_waits``)."""
        if traj is None and sb is not None and sb.first_written_at:
            self.core_waits.ended(cores, time.monotonic())

    def _idle_memory_gb(self, sb: Sandbox) -> float | None:
        """An idle (frozen) session's memory, for the engine to reserve by use; None under
        ``session_memory = 'limit'`` or when it cannot be read (the reservation then stays)."""
        if self.host.config.session_memory != "use":
            return None
        try:
            return sb.memory_bytes() / (1 << 30)
        except (OSError, ValueError) as e:
            log.warning("cannot read the memory of sandbox %s: %s", sb.id, e)
            return None

    def _died(self, e: SandboxDied, action: Action) -> tuple[Outcome, SandboxResult]:
        if action.trajectory is not None:
            self.book.awake.pop(action.trajectory, None)
        if e.deadline:  # the runner could not stop the user's code in time: still the code's timeout
            return Outcome.TIMEOUT, SandboxResult(message=f"timeout: {e}")
        return Outcome.INFRA_ERROR, SandboxResult(message=f"sandbox failure: {e}")
