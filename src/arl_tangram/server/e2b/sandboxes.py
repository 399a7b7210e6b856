"""E2B's sandboxes as Tangram sessions: the engine-process half of the E2B dialect.

An E2B sandbox *is* a session of the ``Service`` (``service.sessions``, so the native API sees
it too): its files persist, and it holds cores only while one of its commands or cells runs.
Here is what E2B adds on top: the sandbox's metadata, environment variables, template, envd
access token and lifetime (``timeout``: an absolute deadline, moved by ``set_timeout`` and
``connect``), its processes (each E2B command is one step of the session, run as a task so
that a background command can be re-attached to) and its code-interpreter state.

Every function taking ``service`` first is a call of the dialect (``server/dialect.py``): it runs
in the engine process and answers plain data, or raises ``E2bError``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import posixpath
import re
import secrets
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ...api import v1
from ...managers.sandbox.images import ImageError
from ...managers.sandbox.isolation import HOME_ALIAS
from ...managers.sandbox.livestdin import LiveStdin
from ...managers.sandbox.spec import Files
from ...runtime import NoRoom, SessionGone
from ...runtime.api import SessionError
from ..journal import JournalError
from ..service import BadRequest, Forbidden, NotFound, Overloaded, Service, job_for, visible
from .envelope import E2bError

#: the envd version we answer as: the behaviour of the calls below is that version's (0.5.7 and
#: newer upload files as octet-stream; 0.6.2 would add file metadata, which we do not keep)
ENVD_VERSION = "0.5.7"
CLIENT_ID = "tangram"
DEFAULT_TIMEOUT_S = 300  # E2B's, when a create names none
MAX_TIMEOUT_S = 86_400
#: templates that mean the server's default sandbox (E2B's base and code-interpreter templates)
DEFAULT_TEMPLATES = frozenset({"base", "code-interpreter-v1", "code-interpreter", "default"})
#: the longest one command or cell may run (the native API's own bound on a session step)
MAX_STEP_S = 3600.0
log = logging.getLogger(__name__)
#: a variable name (the sandbox's environment, a process's, a cell's)
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SNAPSHOT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}")
#: how long a paused sandbox is kept (E2B keeps them until deleted; an idle session holds memory)
MAX_PAUSED_S = 86_400.0
#: the most a file action reads of one file (the runner's own cap)
READ_CAP = 1 << 24
#: E2B's proxy answers a sandbox that is gone with this (its clients match "was not found")
GONE = "The sandbox {id} was not found"


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _field_error(where: str, err: ValidationError) -> E2bError:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    return E2bError(400, f"{where}{'.' + loc if loc and where != loc else ''}: {first['msg']}")


async def poll(out: dict[str, bytearray], changed: asyncio.Event, done: asyncio.Future, sent: tuple[int, int],
               wait_s: float) -> tuple[bytes, bytes, bool]:
    """A long poll of streamed output: ``out``'s bytes past ``sent`` (of stdout, of stderr) once
    there are some, or ``done`` (the third item), or ``wait_s`` has passed (a keepalive's turn)."""
    o, e = sent
    if len(out["stdout"]) <= o and len(out["stderr"]) <= e and not done.done():
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
    return bytes(out["stdout"][o:]), bytes(out["stderr"][e:]), done.done()


@dataclass
class Proc:
    """One E2B process: one step of the sandbox's session."""

    pid: int
    config: dict
    tag: str | None
    shell: str
    timeout_s: float
    stdin: bytearray | None  # open stdin given whole: the step starts once it is closed (no live stdin here)
    done: asyncio.Future
    live: LiveStdin | None = None  # open stdin fed while the step runs (``Session.exec``'s ``live_stdin``)
    action_id: str = ""
    task: asyncio.Task | None = None
    killed: bool = False
    running: bool = False  # its step holds the sandbox
    #: its output so far, as the step streams it (``Session.exec``'s ``on_output``: capped at the
    #: sandbox's ``max_output_bytes`` a stream); ``changed`` is set at each chunk and at its end
    out: dict[str, bytearray] = field(default_factory=lambda: {"stdout": bytearray(), "stderr": bytearray()})
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def output(self, stream: str, data: bytes) -> None:
        self.out[stream] += data
        self.changed.set()


@dataclass
class Box:
    id: str
    job: str
    template: str
    metadata: dict[str, str]
    env: dict[str, str]
    token: str
    started_at: float
    end_at: float
    paused: bool = False
    timer: asyncio.TimerHandle | None = None
    procs: dict[int, Proc] = field(default_factory=dict)
    #: the last few processes whose result was taken: a second stream of one (``Connect``) still
    #: finishes (``processes.ENDED_KEPT`` of them, oldest dropped first)
    ended: dict[int, Proc] = field(default_factory=dict)
    next_pid: int = 1000
    executions: int = 0
    contexts: dict[str, dict] = field(default_factory=dict)
    cpu_sample: tuple[float, float] | None = None  # (when, cpu seconds) at the last metrics call
    cell_env: bool = False  # its interpreter has the sandbox's environment variables
    cell_ctx: str = ""  # the context whose cell ran last in its interpreter ("": the default one)
    used_at: float | None = None  # the last step of its session (None: its sandbox never started)
    #: one step of the session at a time: the sandbox runs one thing at a time anyway, and the
    #: sandbox manager must not be handed a second step of a session while one runs
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    paused_at: float = 0.0


class Boxes:
    """The E2B sandboxes of one service, by id."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.boxes: dict[str, Box] = {}
        service.runtime.session_listeners.append(self.gone)
        self._keeper: asyncio.Task | None = None
        self.snapshots: dict[str, dict] = {}  # id -> {"path", "name", "template"}
        self._snapshot_dir: str | None = None

    def snapshot_path(self, id: str) -> str:
        if self._snapshot_dir is None:  # they name nothing once this server is gone: removed as it stops
            self._snapshot_dir = tempfile.mkdtemp(prefix="tangram-e2b-snapshots-")
            self.service.on_stop.append(lambda: shutil.rmtree(self._snapshot_dir, True))
        return os.path.join(self._snapshot_dir, f"{id}.tar")

    def snapshot(self, name: str) -> dict | None:
        """The snapshot with this id or name that the request's job may see."""
        for id, snap in self.snapshots.items():
            if name in (id, snap["name"]) and visible(snap["job"]):
                return snap
        return None

    def keep_alive(self) -> None:
        """Start (once) what keeps a sandbox's session from the server's idle expiry
        (``sandbox.session_idle_expiry_s``) while its E2B lifetime runs: E2B's ``timeout`` is the
        owner's word for how long it lives. A paused one is kept up to ``MAX_PAUSED_S``."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        config = self.service.runtime.sandbox_config()
        if config is None:
            return  # no idle expiry known here
        idle_s = config.session_idle_expiry_s
        every = max(0.2, idle_s / 4)  # a session is touched at most 2 * every after its last step
        while self.boxes:
            await asyncio.sleep(every)
            now = time.time()
            for box in list(self.boxes.values()):
                alive = now < box.paused_at + MAX_PAUSED_S if box.paused else now < box.end_at
                s = self.service.sessions.get(box.id)
                if alive and s is not None and box.used_at is not None and now - box.used_at > every \
                        and not box.lock.locked():
                    box.used_at = now
                    try:  # an empty files step: no core, no process; it marks the session used
                        async with box.lock:
                            await s.files(Files())
                    except Exception as e:  # gone meanwhile: nothing to keep
                        log.debug("keep-alive of %s: %r", box.id, e)

    def gone(self, sid: str, reason: str) -> None:
        """Sandbox ``sid`` is gone (its session ended, it expired, it was killed): forgotten, and
        what still waits on its processes hears so."""
        box = self.boxes.pop(sid, None)
        if box is None:
            return
        if box.timer is not None:
            box.timer.cancel()
        for proc in box.procs.values():  # what still waits on it hears now that the sandbox is gone
            if not proc.done.done():
                proc.done.set_exception(E2bError(502, GONE.format(id=sid)))

    def arm(self, box: Box) -> None:
        """(Re)start the clock that kills ``box`` at ``end_at`` (none while paused)."""
        if box.timer is not None:
            box.timer.cancel()
            box.timer = None
        if box.paused:
            return
        loop = asyncio.get_running_loop()
        box.timer = loop.call_later(max(0.0, box.end_at - time.time()),
                                    lambda: loop.create_task(self._expire(box.id)))

    async def _expire(self, sid: str) -> None:
        box = self.boxes.get(sid)
        if box is None or box.paused or box.end_at > time.time() + 0.05:
            return
        s = self.service.sessions.get(sid)
        if s is not None:
            await s.close()
        self.gone(sid, "timeout")

    def get(self, sid: str) -> Box:
        """For the control plane: 404 when unknown, gone, or another job's (the API key's job,
        ``service.CALLER_JOB``)."""
        box = self.boxes.get(sid)
        if box is None or not visible(box.job):
            raise E2bError(404, f"sandbox {sid!r} not found")
        return box

    def envd(self, sid: str, token: str | None, required: bool = True) -> Box:
        """For envd and the code interpreter: the sandbox's access token must match (``required``:
        even when none is given; the SDKs send none to ``/contexts``, which runs no code); a
        sandbox that is gone (or paused) answers as E2B's proxy does."""
        box = self.boxes.get(sid)
        if box is None or box.paused:
            raise E2bError(502, GONE.format(id=sid) + (" (it is paused)" if box is not None else ""))
        if (token or required) and not (token and secrets.compare_digest(token, box.token)):
            raise E2bError(401, "missing or wrong X-Access-Token for this sandbox")
        return box


def boxes(service: Service) -> Boxes:
    """The E2B sandboxes of ``service`` (the dialect's state on it)."""
    return service.dialect_state("e2b", Boxes)


def _sandbox(box: Box) -> dict:
    """E2B's ``Sandbox`` (what create and connect answer)."""
    return {"templateID": box.template, "sandboxID": box.id, "clientID": CLIENT_ID, "envdVersion": ENVD_VERSION,
            "envdAccessToken": box.token, "alias": box.template}


def _detail(service: Service, box: Box, listed: bool = False) -> dict:
    """E2B's ``SandboxDetail`` / ``ListedSandbox``."""
    config = service.runtime.sandbox_config()
    out = {"templateID": box.template, "sandboxID": box.id, "clientID": CLIENT_ID, "alias": box.template,
           "startedAt": _iso(box.started_at), "endAt": _iso(box.end_at), "envdVersion": ENVD_VERSION,
           "cpuCount": 1, "memoryMB": config.memory_mb if config is not None else 512, "diskSizeMB": 256,
           "state": "paused" if box.paused else "running", "metadata": dict(box.metadata)}
    if not listed:
        out["envdAccessToken"] = box.token
    return out


def _timeout(value: Any, field_name: str = "timeout") -> int:
    if value is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TIMEOUT_S:
        raise E2bError(400, f"{field_name}: an integer number of seconds from 0 to {MAX_TIMEOUT_S} is expected, "
                            f"got {value!r}")
    return value


def strings(value: Any, field_name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise E2bError(400, f"{field_name}: an object of string values is expected")
    return dict(value)


# -- the control plane -----------------------------------------------------------------------------

async def e2b_create(service: Service, body: dict) -> dict:
    """``POST /v2/sandboxes`` (and ``/sandboxes``): a new session."""
    reg = boxes(service)
    template = body.get("templateID")
    if not isinstance(template, str) or not template:
        raise E2bError(400, "templateID: a template name is expected")
    timeout = _timeout(body.get("timeout"))
    metadata = strings(body.get("metadata"), "metadata")
    env = strings(body.get("envVars"), "envVars")
    for k in env:
        if not VARIABLE.fullmatch(k):
            raise E2bError(400, f"envVars: {k!r} is not a variable name")
    try:
        job = job_for(metadata.get("job"), "e2b", "metadata.job")
    except Forbidden as e:
        raise E2bError(403, str(e)) from None
    sid = metadata.get("trajectory") or f"i{uuid.uuid4().hex[:19]}"
    if sid in service.sessions or sid in reg.boxes:
        raise E2bError(409, f"metadata.trajectory: a sandbox or session {sid!r} is open already")
    snap = reg.snapshot(template)
    if snap is not None:
        return await _from_snapshot(service, reg, snap, sid, job, metadata, env, timeout)
    image = None if template in DEFAULT_TEMPLATES else template
    try:
        req = v1.SessionRequest(job=job, trajectory=sid, image=image)
    except ValidationError as e:
        first = e.errors()[0]
        name = {"job": "metadata.job", "trajectory": "metadata.trajectory", "image": "templateID"}.get(
            str(first["loc"][0]) if first["loc"] else "", "body")
        raise E2bError(400, f"{name}: {first['msg']}") from None
    if image is not None:  # an E2B sandbox is ready when created: a template named by reference is pulled now
        try:
            await service.tg.pull(image)
        except ImageError as e:
            raise E2bError(503 if e.infra else 400, f"templateID: {e}") from None
    try:
        await service.open_session(req)
    except BadRequest as e:
        raise E2bError(400, f"templateID: {e}") from None
    except NoRoom as e:
        raise E2bError(503, str(e)) from None
    now = time.time()
    box = reg.boxes[sid] = Box(sid, job, template, metadata, env, secrets.token_urlsafe(24), now, now + timeout)
    reg.arm(box)
    reg.keep_alive()
    return _sandbox(box)


async def _from_snapshot(service: Service, reg: Boxes, snap: dict, sid: str, job: str, metadata: dict,
                         env: dict, timeout: int) -> dict:
    try:  # an open session as any other: journaled, so a restart knows it
        await service.restore_session(sid, job, snap["path"])
    except NoRoom as e:
        raise E2bError(503, str(e)) from None
    except JournalError:
        raise
    except Exception as e:  # the image it was taken from is gone, the file unreadable
        raise E2bError(400, f"templateID: snapshot {snap['id']} cannot be restored: {e}") from None
    now = time.time()
    box = reg.boxes[sid] = Box(sid, job, snap["id"], metadata, env, secrets.token_urlsafe(24), now, now + timeout)
    box.used_at = now
    reg.arm(box)
    reg.keep_alive()
    return _sandbox(box)


async def e2b_snapshot(service: Service, sid: str, body: dict) -> dict:
    """``POST /sandboxes/{id}/snapshots``: Tangram's snapshot of an image sandbox's files (its
    processes and memory are not kept: a sandbox made from it starts them afresh); the id (or the
    name given) is a template for ``create``."""
    reg = boxes(service)
    box = reg.get(sid)
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not _SNAPSHOT_NAME.fullmatch(name)):
        raise E2bError(400, "name: letters, digits and . _ - / : only")
    if name is not None and reg.snapshot(name) is not None:
        raise E2bError(409, f"name: a snapshot named {name!r} exists")
    s = service.sessions.get(sid)
    if s is None:
        raise E2bError(404, f"sandbox {sid!r} not found")
    id = f"snap-{uuid.uuid4().hex[:16]}"
    path = reg.snapshot_path(id)
    try:
        async with box.lock:
            await s.snapshot(path)
    except SessionError as e:
        raise E2bError(400, f"snapshot: {e.result.message or e.result.outcome.value}") from None
    except (SessionGone, NotFound):
        raise E2bError(404, f"sandbox {sid!r} not found") from None
    reg.snapshots[id] = {"id": id, "path": path, "name": name or id, "template": box.template, "job": box.job}
    return {"snapshotID": id, "names": [name or id]}


def e2b_delete_template(service: Service, name: str) -> None:
    """``DELETE /templates/{id}``: a snapshot this server took (E2B's templates are not served)."""
    reg = boxes(service)
    snap = reg.snapshot(name)
    if snap is None:
        raise E2bError(404, f"template {name!r} not found")
    reg.snapshots.pop(snap["id"], None)
    try:
        os.unlink(snap["path"])
    except OSError:
        pass


def e2b_get(service: Service, sid: str) -> dict:
    return _detail(service, boxes(service).get(sid))


def e2b_list(service: Service, metadata: dict[str, str], states: list[str], limit: int,
             next_token: str | None) -> tuple[list[dict], str | None]:
    """``GET /v2/sandboxes``: by start time, filtered; the next page's token is an offset."""
    for s in states:
        if s not in ("running", "paused"):
            raise E2bError(400, f"state: {s!r} is not running or paused")
    chosen = [b for b in sorted(boxes(service).boxes.values(), key=lambda b: (b.started_at, b.id))
              if visible(b.job) and (not states or ("paused" if b.paused else "running") in states)
              and all(b.metadata.get(k) == v for k, v in metadata.items())]
    try:
        start = int(next_token) if next_token else 0
    except ValueError:
        raise E2bError(400, "nextToken: not a token this server gave") from None
    page = chosen[start:start + limit]
    more = str(start + limit) if start + limit < len(chosen) else None
    return [_detail(service, b, listed=True) for b in page], more


async def e2b_kill(service: Service, sid: str) -> None:
    reg = boxes(service)
    box = reg.get(sid)
    s = service.sessions.get(sid)
    if s is not None:
        await s.close()
    reg.gone(box.id, "killed")


def e2b_set_timeout(service: Service, sid: str, timeout: Any) -> None:
    reg = boxes(service)
    box = reg.get(sid)
    box.end_at = time.time() + _timeout(timeout)
    reg.arm(box)


def e2b_connect(service: Service, sid: str, timeout: Any) -> tuple[dict, bool]:
    """``POST /v2/sandboxes/{id}/connect``: resume a paused sandbox; a timeout given only ever
    extends its life. Answers the sandbox and whether it was resumed (201) or running (200)."""
    reg = boxes(service)
    box = reg.get(sid)
    resumed = box.paused
    box.paused = False
    if timeout is not None:
        box.end_at = max(box.end_at, time.time() + _timeout(timeout))
    elif resumed:
        box.end_at = max(box.end_at, time.time() + DEFAULT_TIMEOUT_S)
    reg.arm(box)
    return _sandbox(box), resumed


def e2b_pause(service: Service, sid: str) -> None:
    """Paused: envd answers as for a sandbox that is gone and the clock stops; the session
    (its files; it holds no cores while idle anyway) stays."""
    reg = boxes(service)
    box = reg.get(sid)
    if box.paused:
        raise E2bError(409, f"sandbox {sid!r} is paused already")
    # not 409: the SDK reads that as "paused already" and returns False, the sandbox still running;
    # a cell holds the box's lock while it runs
    if any(not p.done.done() for p in box.procs.values()) or box.lock.locked():
        raise E2bError(400, f"sandbox {sid!r} has a command or cell running: it cannot be paused until it "
                            "ends (wait for it, or kill it)", "failed_precondition")
    box.paused = True
    box.paused_at = time.time()
    reg.arm(box)


async def e2b_fork(service: Service, sid: str, body: dict) -> list[dict]:
    """``POST /sandboxes/{id}/fork``: Tangram's fork (an image sandbox's files, copy-on-write)
    into ``count`` new sandboxes with the source's template, metadata (but ``trajectory``) and
    environment. The processes of the source and the children start afresh (README)."""
    reg = boxes(service)
    box = reg.get(sid)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 256:
        raise E2bError(400, f"count: an integer from 1 to 256 is expected, got {count!r}")
    timeout = _timeout(body.get("timeout"))
    try:
        async with box.lock:
            res = await service.fork(sid, v1.ForkRequest(n=count))
    except Exception as e:
        raise translate(e, sid) from None
    if res.outcome != "ok":
        raise E2bError(400 if res.outcome == "rejected" else 503, f"fork: {res.message or res.outcome}")
    box.cell_env = False  # the source's interpreter starts afresh too
    now = time.time()
    metadata = {k: v for k, v in box.metadata.items() if k != "trajectory"}
    out = []
    for cid in res.session_ids:
        child = reg.boxes[cid] = Box(cid, box.job, box.template, dict(metadata), dict(box.env),
                                     secrets.token_urlsafe(24), now, now + timeout)
        child.used_at = now  # its files are there: a sandbox to keep
        reg.arm(child)
        out.append({"sandbox": _sandbox(child)})
    return out


def e2b_metrics(service: Service, sid: str) -> list[dict]:
    """``GET /sandboxes/{id}/metrics``: one sample, now, from the session's cgroup (none before its
    sandbox has started, or where this process does not hold it)."""
    box = boxes(service).get(sid)
    usage = service.runtime.session_usage(sid)
    if usage is None:
        return []
    mem, cpu = usage
    now = time.time()
    last_t, last_cpu = box.cpu_sample or (box.started_at, 0.0)
    box.cpu_sample = (now, cpu)
    config = service.runtime.sandbox_config()
    memory_mb, workspace_mb = (config.memory_mb, config.workspace_mb) if config is not None else (512, 256)
    return [{"timestamp": _iso(now), "timestampUnix": int(now), "cpuCount": 1,
             "cpuUsedPct": round(100.0 * max(0.0, cpu - last_cpu) / max(1e-6, now - last_t), 2),
             "memUsed": mem, "memTotal": memory_mb << 20, "memCache": 0,
             "diskUsed": 0, "diskTotal": workspace_mb << 20}]



# -- shared by the calls ---------------------------------------------------------------------------

def step_s(box: Box, timeout_s: float | None) -> float:
    left = max(1.0, box.end_at - time.time())
    return min(MAX_STEP_S, left, timeout_s) if timeout_s else min(MAX_STEP_S, left)


def callers_error(err: BaseException) -> bool:
    """Whether an exception that stops a journaled step is the caller's fault (``Service.step``'s
    ``rejects``): an ``E2bError`` of a 4xx; anything else is ours."""
    return isinstance(err, E2bError) and err.status < 500


def translate(e: BaseException, sid: str) -> E2bError:
    if isinstance(e, E2bError):
        return e
    if isinstance(e, (SessionGone, NotFound)):
        return E2bError(502, GONE.format(id=sid))
    if isinstance(e, Overloaded):
        return E2bError(429, str(e))
    if isinstance(e, NoRoom):
        return E2bError(503, str(e))
    if isinstance(e, asyncio.CancelledError):
        return E2bError(503, "the server is shutting down", "unavailable")
    return E2bError(500, f"internal error: {type(e).__name__}", "internal")


def abs_path(path: Any, field_name: str = "path") -> str:
    """An absolute, normalised path; relative ones are under the home directory, as in E2B."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise E2bError(400, f"{field_name}: a path is expected")
    full = posixpath.normpath(path if path.startswith("/") else posixpath.join(HOME_ALIAS, path))
    return "/" + full.lstrip("/")


CALLS = {
    "e2b_create": e2b_create, "e2b_get": e2b_get, "e2b_list": e2b_list, "e2b_kill": e2b_kill,
    "e2b_set_timeout": e2b_set_timeout, "e2b_connect": e2b_connect, "e2b_pause": e2b_pause,
    "e2b_fork": e2b_fork, "e2b_metrics": e2b_metrics, "e2b_snapshot": e2b_snapshot,
    "e2b_delete_template": e2b_delete_template,
}
