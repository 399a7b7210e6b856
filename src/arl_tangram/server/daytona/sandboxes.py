"""Daytona's sandboxes as Tangram sessions: the control plane, in the engine process.

A Daytona sandbox *is* a session of the ``Service`` (``service.sessions``: the native API sees it
too); it holds cores only while one of its commands runs. What Daytona adds is kept here, beside
the session: the sandbox's name, labels, environment, resources (mapped onto each step's cores
and memory limit), its state (``started``, ``stopped``: a stopped sandbox's session rests, its
files kept), its auto-stop and auto-delete intervals, its process sessions and commands
(``process.py``), the remotes its git repositories were cloned from (``git.py``), and the
snapshots taken of sandboxes. State changes are kept as events for the SDK's event connection
(``daytona_events``).

Every function taking ``service`` first is a call of the dialect (``server/dialect.py``): it runs
in the engine process and answers plain data, or raises ``DaytonaApiError``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ... import __version__
from ...api import v1
from ...managers.sandbox.spec import Files
from ...runtime import NoRoom, SessionGone
from ..journal import JournalError
from ..service import BadRequest, Conflict, Forbidden, NotFound, Overloaded, Service, Unavailable, job_for, visible
from .errors import DaytonaApiError

log = logging.getLogger(__name__)

#: the label the SDK sets to the language its ``code_run`` uses
LANGUAGE_LABEL = "code-toolbox-language"
#: Daytona's defaults, in minutes (-1: never deleted)
AUTO_STOP_MIN, AUTO_ARCHIVE_MIN, AUTO_DELETE_MIN = 15, 7 * 24 * 60, -1
#: the user a sandbox's commands run as, and its home (the workspace)
USER = "user"
#: the longest a stopped sandbox is kept without an auto-delete interval (an idle session holds memory)
MAX_STOPPED_S = 86_400.0
#: the longest one command may run (the native API's own bound on a session step)
MAX_STEP_S = 3600.0
#: state changes kept for the event connection (a client further behind misses the oldest)
EVENTS_KEPT = 10_000
#: a sandbox list's page
PAGE_DEFAULT, PAGE_MAX = 100, 200
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


@dataclass
class Box:
    """One Daytona sandbox (its session is ``service.sessions[id]``)."""

    id: str
    name: str
    job: str
    labels: dict[str, str]
    env: dict[str, str]
    cpu: int
    memory_gb: int
    disk_gb: int
    memory_mb: int | None  # each step's memory limit (None: the server's default)
    image: str | None
    snapshot: str | None  # the snapshot (or image) it was created from, as the caller named it
    created: float
    state: str = "started"
    updated: float = 0.0
    used_at: float = 0.0  # its last toolbox call's end (auto-stop counts from it)
    stopped_at: float = 0.0
    auto_stop: int = AUTO_STOP_MIN
    auto_archive: int = AUTO_ARCHIVE_MIN
    auto_delete: int = AUTO_DELETE_MIN
    destroy_at: float | None = None  # its time to live, from creation (``ttlMinutes``)
    public: bool = False
    busy: int = 0  # toolbox calls in flight: never stopped under one
    stepped: float = 0.0  # its session's last step of the dialect's (a keep-alive step included)
    sessions: dict[str, Any] = field(default_factory=dict)  # process sessions (``process.py``)
    remotes: dict[str, dict] = field(default_factory=dict)  # git: repository path -> where it was cloned from


class Sandboxes:
    """The Daytona sandboxes and snapshots of one service, and the events of their states."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.boxes: dict[str, Box] = {}
        self.snapshots: dict[str, dict] = {}  # id -> its record (``_snapshot_dto``)
        self.events: deque[tuple[int, str, str, dict]] = deque(maxlen=EVENTS_KEPT)  # (seq, job, event, data)
        self.seq = 0
        self._changed: asyncio.Future | None = None
        self._keeper: asyncio.Task | None = None
        service.runtime.session_listeners.append(self.gone)

    # -- lookups ---------------------------------------------------------------------------------
    def get(self, key: str) -> Box:
        """The sandbox with this id or name that the request may see; else a 404."""
        box = self.boxes.get(key)
        if box is None or not visible(box.job):
            box = next((b for b in self.boxes.values() if b.name == key and visible(b.job)), None)
        if box is None:
            raise DaytonaApiError(404, f"Sandbox with ID or name {key} not found")
        return box

    def toolbox(self, sid: str) -> Box:
        """For a toolbox call: a started sandbox the request may see, whose session is open."""
        box = self.boxes.get(sid)
        if box is None or not visible(box.job) or sid not in self.service.sessions:
            raise DaytonaApiError(404, f"Sandbox {sid} not found")
        if box.state != "started":
            raise DaytonaApiError(409, f"Sandbox {sid} is {box.state}: start it first")
        return box

    def snapshot(self, key: str) -> dict | None:
        for snap in self.snapshots.values():
            if key in (snap["id"], snap["name"]) and visible(snap["job"]):
                return snap
        return None

    # -- events ----------------------------------------------------------------------------------
    def emit(self, box: Box, event: str, old: str | None = None) -> None:
        """An event for the event connection (``daytona_events``): the sandbox as it is now."""
        data: dict = {"sandbox": dto(self.service, box)}
        if event == "sandbox.state.updated":
            data.update(oldState=old, newState=box.state)
        self.seq += 1
        self.events.append((self.seq, box.job, event, data))
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def set_state(self, box: Box, state: str) -> None:
        old, box.state = box.state, state
        box.updated = time.time()
        if state == "stopped":
            box.stopped_at = box.updated
        if old != state:
            self.emit(box, "sandbox.state.updated", old)

    async def wait_event(self, after: int, wait_s: float) -> None:
        if self.seq > after:
            return
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._changed), wait_s)
        except asyncio.TimeoutError:
            pass

    # -- lifetimes -------------------------------------------------------------------------------
    def gone(self, sid: str, reason: str) -> None:
        """Sandbox ``sid``'s session ended (deleted, expired, its node lost): it is destroyed, and
        whatever waits on its commands hears so."""
        box = self.boxes.pop(sid, None)
        if box is None:
            return
        self.set_state(box, "destroyed")
        for ps in box.sessions.values():
            ps.gone(sid)

    def keep(self) -> None:
        """Start (once) what stops, deletes and keeps the sandboxes by their intervals."""
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """Auto-stop (idle ``auto_stop`` minutes, no call in flight), auto-delete (stopped
        ``auto_delete`` minutes), the time to live; and each sandbox's session touched before the
        server's idle expiry (``sandbox.session_idle_expiry_s``) would close it: Daytona's intervals
        are their owner's word for how long it lives (a stopped one at most ``MAX_STOPPED_S``)."""
        config = self.service.runtime.sandbox_config()
        every = max(0.2, config.session_idle_expiry_s / 4) if config is not None else None
        tick = min(5.0, every) if every is not None else 5.0
        while self.boxes:
            await asyncio.sleep(tick)
            now = time.time()
            for box in list(self.boxes.values()):
                try:
                    await self._tend(box, now, every)
                except Exception as e:  # gone meanwhile: nothing to keep
                    log.debug("daytona sandbox %s: %r", box.id, e)

    async def _tend(self, box: Box, now: float, every: float | None) -> None:
        if box.destroy_at is not None and now >= box.destroy_at:
            await delete(self.service, box)
            return
        if box.state == "started" and box.auto_stop > 0 and not box.busy and now - box.used_at >= box.auto_stop * 60:
            await stop(self.service, box)
        elif box.state == "stopped" and ((box.auto_delete >= 0 and now - box.stopped_at >= box.auto_delete * 60)
                                         or now - box.stopped_at >= MAX_STOPPED_S):
            await delete(self.service, box)
            return
        s = self.service.sessions.get(box.id)
        if every is None or s is None or box.busy:
            return
        # touched only as the expiry nears: the touch wakes a session at rest, which rests again
        # soon after (``sandbox.rest_after_s``)
        if now - max(box.stepped, box.created) > 3 * every:
            box.stepped = now
            await s.files(Files())  # an empty files step: no core, no process; it marks the session used


def sandboxes(service: Service) -> Sandboxes:
    """The Daytona sandboxes of ``service`` (the dialect's state on it)."""
    return service.dialect_state("daytona", Sandboxes)


def dto(service: Service, box: Box, listed: bool = False) -> dict:
    """Daytona's ``Sandbox`` (or ``SandboxListItem``), less ``toolboxProxyUrl``: the route adds
    it, from the address the request came to."""
    out = {"id": box.id, "organizationId": box.job, "name": box.name, "snapshot": box.snapshot, "user": USER,
           "labels": dict(box.labels), "public": box.public, "networkBlockAll": True, "target": "local",
           "cpu": box.cpu, "gpu": 0, "memory": box.memory_gb, "disk": box.disk_gb, "state": box.state,
           "desiredState": "destroyed" if box.state == "destroyed" else box.state, "errorReason": None,
           "recoverable": False, "backupState": "None", "autoStopInterval": box.auto_stop,
           "autoPauseInterval": 0, "autoArchiveInterval": box.auto_archive, "autoDeleteInterval": box.auto_delete,
           "autoDestroyAt": iso(box.destroy_at) if box.destroy_at is not None else None,
           "createdAt": iso(box.created), "updatedAt": iso(box.updated or box.created),
           "lastActivityAt": iso(box.used_at or box.created), "sandboxClass": "container",
           "daemonVersion": f"tangram-{__version__}", "runnerId": "local"}
    if not listed:
        out.update(env=dict(box.env), kvm=False, volumes=[], buildInfo=None)
    return out


# -- parsing the control plane's bodies --------------------------------------------------------------

def strings(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise DaytonaApiError(400, f"{name}: an object of string values is expected")
    return dict(value)


def variables(value: Any, name: str) -> dict[str, str]:
    out = strings(value, name)
    for k in out:
        if not VARIABLE.fullmatch(k):
            raise DaytonaApiError(400, f"{name}: {k!r} is not a variable name")
    return out


def minutes(value: Any, name: str, default: int, low: int = 0) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 10 ** 7:
        raise DaytonaApiError(400, f"{name}: an integer number of minutes from {low} is expected, got {value!r}")
    return value


def _resources(service: Service, body: dict) -> tuple[int, int, int, int | None]:
    """(cores, memory GiB, disk GiB, each step's memory limit in MB): the cores each command
    asks the scheduler for, the memory its cgroup may use; the disk is the server's workspace
    size, whatever is asked (it is one size for every session)."""
    config = service.runtime.sandbox_config()
    memory_mb = config.memory_mb if config is not None else 512
    workspace_mb = config.workspace_mb if config is not None else 256
    for k in ("cpu", "memory", "disk", "gpu"):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise DaytonaApiError(400, f"{k}: a non-negative integer is expected, got {v!r}")
    if body.get("gpu"):
        raise DaytonaApiError(400, "gpu: sandboxes have no GPUs on this server (model services are its GPUs' work)")
    cpu = body.get("cpu") or 1
    largest = service.runtime.engine.cpu.max_cores
    if largest and cpu > largest:
        raise DaytonaApiError(400, f"cpu: {cpu} cores is more than the largest node has ({largest})")
    memory = body.get("memory")
    step_mb = None
    if memory:
        total_gb = service.runtime.snapshot().memory_gb
        if total_gb and memory > total_gb:
            raise DaytonaApiError(400, f"memory: {memory} GiB is more than the server's nodes have "
                                       f"({total_gb:.0f} GiB)")
        step_mb = memory << 10
    return cpu, memory or max(1, math.ceil(memory_mb / 1024)), max(1, math.ceil(workspace_mb / 1024)), step_mb


def _image_of(body: dict) -> str | None:
    """The image a ``buildInfo`` names: a Dockerfile of one ``FROM`` (what the SDK sends for
    ``CreateSandboxFromImageParams(image="name")``); anything to build is refused."""
    info = body.get("buildInfo")
    if info is None:
        return None
    text = info.get("dockerfileContent") if isinstance(info, dict) else None
    if not isinstance(text, str):
        raise DaytonaApiError(400, "buildInfo.dockerfileContent: a Dockerfile is expected")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    words = lines[0].split() if len(lines) == 1 else []
    if len(words) not in (2, 4) or words[0].upper() != "FROM" or (len(words) == 4 and words[2].upper() != "AS"):
        raise DaytonaApiError(400, "buildInfo: this server builds no images; it runs an image by name "
                                   "(Image.base(name)): one of its store (`tangram image import`), or a registry "
                                   "reference, pulled on first use")
    return words[1]


NO_NETWORK = "network access (sandboxes have no network here)"
UNSUPPORTED = {"volumes": "volumes", "secrets": "secrets", "networkAllowList": NO_NETWORK,
               "domainAllowList": NO_NETWORK, "outboundProxyUrl": NO_NETWORK, "linkedSandbox": "linked sandboxes"}


# -- the control plane -----------------------------------------------------------------------------

async def daytona_create(service: Service, body: dict) -> dict:
    """``POST /api/sandbox``: a new session, started (its sandbox comes from the warm pool on its
    first command)."""
    reg = sandboxes(service)
    for k, what in UNSUPPORTED.items():
        if body.get(k):
            raise DaytonaApiError(400, f"{k}: {what} are not supported by this server")
    if body.get("autoPauseInterval"):
        raise DaytonaApiError(400, "autoPauseInterval: pausing is not supported; use autoStopInterval (a stopped "
                                   "sandbox keeps its files and holds no cores)")
    labels = strings(body.get("labels"), "labels")
    env = variables(body.get("env"), "env")
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not NAME.fullmatch(name)):
        raise DaytonaApiError(400, "name: letters, digits and . _ - only (at most 128), starting with a letter or "
                                   "digit")
    try:
        job = job_for(labels.get("job"), "daytona", "labels.job")
    except Forbidden as e:
        raise DaytonaApiError(403, str(e)) from None
    if name is not None and any(b.name == name and b.job == job for b in reg.boxes.values()):
        raise DaytonaApiError(409, f"Sandbox with name {name} already exists")
    cpu, memory_gb, disk_gb, step_mb = _resources(service, body)
    auto_stop = minutes(body.get("autoStopInterval"), "autoStopInterval", AUTO_STOP_MIN)
    auto_archive = minutes(body.get("autoArchiveInterval"), "autoArchiveInterval", AUTO_ARCHIVE_MIN)
    auto_delete = minutes(body.get("autoDeleteInterval"), "autoDeleteInterval", AUTO_DELETE_MIN, low=-1)
    ttl = minutes(body.get("ttlMinutes"), "ttlMinutes", 0)
    image = _image_of(body)
    shown = image
    snap = None
    key = body.get("snapshot")
    if key is not None:
        if not isinstance(key, str) or image is not None:
            raise DaytonaApiError(400, "snapshot: a snapshot's name or id, or buildInfo, not both")
        snap = reg.snapshot(key)
        shown = key
        if snap is None:
            if key not in {i.name for i in service.images()}:
                raise DaytonaApiError(404, f"Snapshot {key} not found")
            image = key
        elif snap.get("image_only"):
            image = snap["image"]
    sid = str(uuid.uuid4())
    try:
        if snap is not None and not snap.get("image_only"):
            await service.open_session(v1.SessionRequest(job=job, trajectory=sid, restore=snap["store_id"]))
        else:
            await service.open_session(v1.SessionRequest(job=job, trajectory=sid, image=image))
    except ValidationError as e:
        raise DaytonaApiError(400, f"{'snapshot' if key else 'buildInfo'}: {e.errors()[0]['msg']}") from None
    except (BadRequest, ValueError) as e:
        raise DaytonaApiError(400, f"{'snapshot' if key else 'buildInfo'}: {e}") from None
    except NoRoom as e:
        raise DaytonaApiError(503, str(e)) from None
    except (NotFound, Conflict) as e:
        raise DaytonaApiError(404 if isinstance(e, NotFound) else 409, str(e)) from None
    except Unavailable as e:
        raise DaytonaApiError(503, str(e)) from None
    now = time.time()
    box = reg.boxes[sid] = Box(sid, name or sid, job, labels, env, cpu, memory_gb, disk_gb, step_mb, image, shown,
                               now, updated=now, used_at=now, auto_stop=auto_stop, auto_archive=auto_archive,
                               auto_delete=auto_delete, destroy_at=now + ttl * 60 if ttl else None,
                               public=bool(body.get("public")))
    reg.emit(box, "sandbox.created")
    reg.keep()
    return dto(service, box)


def daytona_get(service: Service, key: str) -> dict:
    return dto(service, sandboxes(service).get(key))


def daytona_list(service: Service, query: dict) -> dict:
    """``GET /api/sandbox``: the request's sandboxes, filtered, newest first (or as ``sort``
    and ``order`` say), a page at a time; the cursor is an offset."""
    labels = query.get("labels") or {}
    states = set(query.get("states") or ())
    chosen = [b for b in sandboxes(service).boxes.values() if visible(b.job)
              and all(b.labels.get(k) == v for k, v in labels.items())
              and (not states or b.state in states)
              and (not query.get("id") or b.id.lower().startswith(query["id"].lower()))
              and (not query.get("name") or b.name.lower().startswith(query["name"].lower()))
              and (not query.get("snapshots") or b.snapshot in query["snapshots"])]
    sort = query.get("sort") or "createdAt"
    keys = {"name": lambda b: b.name, "cpu": lambda b: b.cpu, "memoryGiB": lambda b: b.memory_gb,
            "diskGiB": lambda b: b.disk_gb, "lastActivityAt": lambda b: b.used_at, "updatedAt": lambda b: b.updated}
    chosen.sort(key=lambda b: (keys.get(sort, lambda b: b.created)(b), b.id), reverse=query.get("order") != "asc")
    start, limit = query.get("cursor") or 0, query.get("limit") or PAGE_DEFAULT
    page = chosen[start:start + limit]
    more = str(start + limit) if start + limit < len(chosen) else None
    return {"items": [dto(service, b, listed=True) for b in page], "nextCursor": more}


async def stop(service: Service, box: Box, force: bool = False) -> None:
    """Stopped: its running command interrupted, its session put to rest now where it runs in
    this process (its files kept on disk, no processes, no memory held); toolbox calls are refused
    until it is started. An ``autoDeleteInterval`` of 0 deletes it at once."""
    reg = sandboxes(service)
    if box.state != "started":
        return
    if box.busy or any(ps.running() for ps in box.sessions.values()):
        service.runtime.interrupt_step(box.id)
    reg.set_state(box, "stopped")
    if box.auto_delete == 0:
        await delete(service, box)
        return
    manager = service.runtime.sandbox_manager()
    if manager is not None and service.runtime.session_state(box.id) in ("awake", "pending"):
        try:
            await manager.rest(box.id)
        except Exception as e:  # it stays awake: it rests when the server's own rest comes to it
            log.info("daytona sandbox %s: not put to rest at its stop: %r", box.id, e)


async def delete(service: Service, box: Box) -> None:
    s = service.sessions.get(box.id)
    if s is not None:
        await s.close()  # the runtime tells ``Sandboxes.gone``
    sandboxes(service).gone(box.id, "deleted")


async def daytona_start(service: Service, key: str) -> dict:
    reg = sandboxes(service)
    box = reg.get(key)
    if box.state == "stopped":
        box.used_at = time.time()
        reg.set_state(box, "started")
    return dto(service, box)


async def daytona_stop(service: Service, key: str, force: bool) -> dict:
    box = sandboxes(service).get(key)
    await stop(service, box, force)
    return dto(service, box)


async def daytona_delete(service: Service, key: str) -> dict:
    box = sandboxes(service).get(key)
    await delete(service, box)
    return dto(service, box)


def daytona_labels(service: Service, key: str, body: dict) -> dict:
    """``PUT /api/sandbox/{id}/labels``: its labels replaced (``job`` is its job's, and stays)."""
    reg = sandboxes(service)
    box = reg.get(key)
    labels = strings(body.get("labels"), "labels")
    if labels.get("job", box.job) != box.job:
        raise DaytonaApiError(400, "labels.job: a sandbox's job does not change")
    box.labels = labels
    box.updated = time.time()
    return {"labels": dict(labels)}


INTERVALS = {"autostop": ("auto_stop", 0), "autodelete": ("auto_delete", -1), "autoarchive": ("auto_archive", 0)}


def daytona_interval(service: Service, key: str, kind: str, value: Any) -> dict:
    """``POST /api/sandbox/{id}/autostop|autodelete|autoarchive/{minutes}``, and ``ttl``."""
    reg = sandboxes(service)
    box = reg.get(key)
    if kind == "autopause":
        if value:
            raise DaytonaApiError(400, "autoPauseInterval: pausing is not supported; use the auto-stop interval")
        return dto(service, box)
    if kind == "ttl":
        ttl = minutes(value, "ttlMinutes", 0)
        box.destroy_at = box.created + ttl * 60 if ttl else None
    else:
        attr, low = INTERVALS[kind]
        setattr(box, attr, minutes(value, f"{kind} interval", 0, low))
    box.updated = time.time()
    reg.keep()
    return dto(service, box)


async def daytona_fork(service: Service, key: str, body: dict) -> dict:
    """``POST /api/sandbox/{id}/fork``: Tangram's fork (the files, copy-on-write) into a new
    started sandbox with the source's labels, environment and resources; the processes of both
    start afresh (docs/daytona.md)."""
    reg = sandboxes(service)
    box = reg.get(key)
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not NAME.fullmatch(name)):
        raise DaytonaApiError(400, "name: letters, digits and . _ - only")
    if name is not None and any(b.name == name and b.job == box.job for b in reg.boxes.values()):
        raise DaytonaApiError(409, f"Sandbox with name {name} already exists")
    try:
        res = await service.fork(box.id, v1.ForkRequest(n=1))
    except Exception as e:
        raise translate(e, box.id) from None
    if res.outcome != "ok":
        raise DaytonaApiError(400 if res.outcome == "rejected" else 503, f"fork: {res.message or res.outcome}")
    [cid] = res.session_ids
    now = time.time()
    child = reg.boxes[cid] = Box(cid, name or cid, box.job, dict(box.labels), dict(box.env), box.cpu, box.memory_gb,
                                 box.disk_gb, box.memory_mb, box.image, box.snapshot, now, updated=now, used_at=now,
                                 auto_stop=box.auto_stop, auto_archive=box.auto_archive, auto_delete=box.auto_delete)
    reg.emit(child, "sandbox.created")
    reg.keep()
    return dto(service, child)


# -- snapshots -------------------------------------------------------------------------------------

def _snapshot_dto(snap: dict) -> dict:
    return {"id": snap["id"], "organizationId": snap["job"], "general": False, "name": snap["name"],
            "imageName": snap.get("image"), "state": "active", "size": snap.get("size"), "entrypoint": None,
            "cpu": 1, "gpu": 0, "mem": 1, "disk": 1, "errorReason": None, "createdAt": iso(snap["created"]),
            "updatedAt": iso(snap["created"]), "lastUsedAt": None, "buildInfo": None, "regionIds": ["local"],
            "initialRunnerId": None, "ref": None, "sourceSandboxId": snap.get("source"),
            "sandboxClass": "container"}


def _new_snapshot_name(reg: Sandboxes, name: Any, job: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise DaytonaApiError(400, "name: letters, digits and . _ - only (at most 128)")
    if any(s["name"] == name and s["job"] == job for s in reg.snapshots.values()):
        raise DaytonaApiError(409, f"Snapshot with name {name} already exists")
    return name


async def daytona_snapshot_sandbox(service: Service, key: str, body: dict) -> dict:
    """``POST /api/sandbox/{id}/snapshot``: Tangram's snapshot of the sandbox's files, kept by the
    server (``GET /v1/snapshots``), named for ``create(snapshot=name)``. Its processes are not
    kept: a sandbox made from it starts them afresh."""
    reg = sandboxes(service)
    box = reg.get(key)
    name = _new_snapshot_name(reg, body.get("name"), box.job)
    try:
        info = await service.snapshot(box.id)
    except BadRequest as e:
        raise DaytonaApiError(400, f"snapshot: {e}") from None
    except Exception as e:
        raise translate(e, box.id) from None
    sid = str(uuid.uuid4())
    reg.snapshots[sid] = {"id": sid, "name": name, "job": box.job, "store_id": info.snapshot, "image": box.image,
                          "source": box.id, "size": info.bytes, "created": time.time()}
    return dto(service, box)


def daytona_snapshots(service: Service, page: int, limit: int) -> dict:
    mine = sorted((s for s in sandboxes(service).snapshots.values() if visible(s["job"])), key=lambda s: s["created"])
    total = len(mine)
    return {"items": [_snapshot_dto(s) for s in mine[(page - 1) * limit:page * limit]], "total": total,
            "page": page, "totalPages": max(1, math.ceil(total / limit))}


def daytona_snapshot_get(service: Service, key: str) -> dict:
    snap = sandboxes(service).snapshot(key)
    if snap is None:
        raise DaytonaApiError(404, f"Snapshot with ID or name {key} not found")
    return _snapshot_dto(snap)


def daytona_snapshot_create(service: Service, body: dict) -> dict:
    """``POST /api/snapshots``: a name for an image of the server's store (this server builds
    none: a ``buildInfo`` is accepted only as a single ``FROM``)."""
    reg = sandboxes(service)
    try:
        job = job_for(None, "daytona")
    except Forbidden as e:
        raise DaytonaApiError(403, str(e)) from None
    name = _new_snapshot_name(reg, body.get("name"), job)
    image = _image_of(body) or body.get("imageName")
    if not isinstance(image, str) or not image:
        raise DaytonaApiError(400, "imageName: an image of the server's store is expected")
    if image not in {i.name for i in service.images()}:
        raise DaytonaApiError(400, f"imageName: no image {image!r} on this server (`tangram image import` or "
                                   "`tangram image pull` it first)")
    sid = str(uuid.uuid4())
    snap = reg.snapshots[sid] = {"id": sid, "name": name, "job": job, "image": image, "image_only": True,
                                 "created": time.time()}
    return _snapshot_dto(snap)


def daytona_snapshot_delete(service: Service, key: str) -> None:
    reg = sandboxes(service)
    snap = reg.snapshot(key)
    if snap is None:
        raise DaytonaApiError(404, f"Snapshot with ID or name {key} not found")
    reg.snapshots.pop(snap["id"], None)
    if snap.get("store_id"):
        try:
            service.delete_snapshot(snap["store_id"])
        except NotFound:
            pass


async def daytona_events(service: Service, after: int | None, wait_s: float) -> tuple[list[tuple[str, dict]], int]:
    """The event connection's long poll: the state events of the request's sandboxes after
    ``after`` (None: from now on), once there are some or ``wait_s`` has passed."""
    reg = sandboxes(service)
    if after is None:
        return [], reg.seq
    await reg.wait_event(after, wait_s)
    return [(name, data) for seq, job, name, data in reg.events if seq > after and visible(job)], reg.seq


def translate(e: BaseException, sid: str) -> DaytonaApiError:
    """An error of the service or the runtime, in Daytona's terms."""
    if isinstance(e, DaytonaApiError):
        return e
    if isinstance(e, (SessionGone, NotFound)):
        return DaytonaApiError(404, f"Sandbox {sid} not found")
    if isinstance(e, Overloaded):
        return DaytonaApiError(429, str(e))
    if isinstance(e, (NoRoom, Unavailable, JournalError)):
        return DaytonaApiError(503, str(e))
    if isinstance(e, (BadRequest, ValueError)):
        return DaytonaApiError(400, str(e))
    if isinstance(e, asyncio.CancelledError):
        return DaytonaApiError(503, "the server is shutting down")
    return DaytonaApiError(500, f"internal error: {type(e).__name__}")


def parse_labels(raw: str | None) -> dict[str, str]:
    """The ``labels`` query parameter: a JSON object of strings."""
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        raise DaytonaApiError(400, "labels: a JSON object is expected") from None
    return strings(value, "labels")


CALLS = {
    "daytona_create": daytona_create, "daytona_get": daytona_get, "daytona_list": daytona_list,
    "daytona_start": daytona_start, "daytona_stop": daytona_stop, "daytona_delete": daytona_delete,
    "daytona_labels": daytona_labels, "daytona_interval": daytona_interval, "daytona_fork": daytona_fork,
    "daytona_snapshot_sandbox": daytona_snapshot_sandbox, "daytona_snapshots": daytona_snapshots,
    "daytona_snapshot_get": daytona_snapshot_get, "daytona_snapshot_create": daytona_snapshot_create,
    "daytona_snapshot_delete": daytona_snapshot_delete, "daytona_events": daytona_events,
}
