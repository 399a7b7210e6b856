"""What the sandbox manager is asked and answers: its config, requests and results. Plain data.

The embedded API, the server, the sandbox workers and the node agents build and read these; only
``manager`` carries them out. So they import this module, not the manager and what it pulls in
(cgroups, images, isolation, the runner).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from ...core.action import by_fields

from .isolation import Isolation
from .registry.config import RegistriesConfig


class SandboxConfig(BaseModel):
    """Every knob of the sandbox manager (units in the names)."""

    isolation: Isolation = Field(Isolation.AUTO, description="auto = bubblewrap, else unshare; none only for "
                                                             "trusted code, and only when set explicitly")
    interpreter: str = Field("/usr/bin/python3", description="python seen inside the sandbox (a venv's python "
                                                             "with the tasks' packages, say)")
    interpreter_args: tuple[str, ...] = Field(("-I",), description="flags for it; -S skips site (faster start, no "
                                                                   "site-packages)")
    ro_binds: tuple[str, ...] = Field((), description="host paths visible read-only inside (e.g. the venv)")
    workspace_mb: int = Field(256, ge=1, description="size of a session's private workspace (tmpfs)")
    tmp_mb: int = Field(64, ge=1, description="size of the private /tmp (tmpfs)")
    memory_mb: int = Field(512, ge=16, description="default memory limit of an action's sandbox")
    pids_max: int = Field(128, ge=8, description="processes and threads a sandbox may have")
    max_output_bytes: int = Field(1 << 20, ge=1024, description="stdout/stderr kept per stream; more is dropped "
                                                                "and flagged")
    warm_pool: int = Field(4, ge=0, description="prepared sandboxes waiting for one-shot runs and new sessions")
    warm_sessions: int = Field(4, ge=0, description="layered sandboxes (copy-on-write workspace: they fork and "
                                                    "snapshot) waiting for new default sessions, within "
                                                    "max_idle_sandboxes beside warm_pool")
    warm_shell: bool = Field(True, description="start the persistent shell in the sessions' warm sandboxes, "
                                               "so that a session's first command does not wait for it (one "
                                               "idle bash per such sandbox; off: started on the first command)")
    recycle: bool = Field(True, description="reuse a one-shot's sandbox after a verified wipe (bubblewrap only; "
                                            "see managers/sandbox/recycle.py for what is reset and checked)")
    recycle_pool_max: int = Field(32, ge=0, description="idle sandboxes kept for reuse (within max_idle_sandboxes); "
                                                        "more are killed")
    recycle_max_uses: int = Field(1000, ge=1, description="one-shots a sandbox runs at most before it is replaced "
                                                           "(each its own count, so that sandboxes do not wear out "
                                                           "together: from half of this to all of it until the "
                                                           "first wears out, from nine tenths after)")
    fork_ahead: bool = Field(True, description="the reset of a recycled sandbox whose last one-shot was python "
                                               "forks the next python child ahead, and one whose last was bash starts "
                                               "the next bash ahead, off the next run's latency path (inside/procs.py: "
                                               "Zygote, a bash started ahead)")
    session_idle_expiry_s: float = Field(600.0, gt=0, description="close a session unused for this long")
    session_memory: Literal["use", "limit"] = Field("use", description="what an idle session reserves on its node: "
                                                   "'use' = its measured memory (cgroup charge, refreshed each time "
                                                   "it goes idle) plus session_headroom_mb; 'limit' = its whole "
                                                   "memory limit (no overcommit: far fewer sessions fit)")
    session_headroom_mb: int = Field(8, ge=0, description="reserved for an idle session on top of its measured "
                                                          "memory")
    min_free_memory_mb: int = Field(1024, ge=0, description="new sessions are refused (HTTP 503) while the host's "
                                                            "available memory (MemAvailable) is below this")
    rest_after_s: float = Field(120.0, ge=0, description="put a session idle this long to rest: its python "
                                "state and tmpfs files to disk, its processes ended; its next step wakes it "
                                "(0: only when more than max_awake_sessions are awake)")
    max_awake_sessions: int = Field(640, ge=0, description="idle sessions kept awake (processes running, frozen); "
                                    "past this the least recently used are put to rest (640: ~8.5 GB at ~13 MB "
                                    "an awake session)")
    rest_dir: str | None = Field(None, description="where rested sessions' state goes (default: a temporary "
                                 "directory; the server uses one beside its journal, so rested sessions survive "
                                 "a restart)")
    rest_disk_mb: int = Field(20480, ge=1, description="disk rested sessions may use; past it new sessions are "
                              "refused (HTTP 503 naming this limit)")
    grace_s: float = Field(5.0, gt=0, description="past an action's timeout plus this, the sandbox is killed")
    cpus: tuple[int, ...] | None = Field(None, description="host CPUs to use (default: this process's affinity)")
    one_shots_share_cpus: bool = Field(True, description="a one-shot runs on any of the host CPUs, bounded to its "
                                        "cores' worth of CPU time (the cgroup cpu controller's quota), instead of "
                                        "pinned to its cores: a run no longer waits for its own CPU while another "
                                        "is idle (16 cores: 1.07-1.23x one-shots/s). Where "
                                        "the cpu controller is not ours, or there are no cgroups, one-shots are "
                                        "pinned as sessions are")
    image: str | None = Field(None, description="image for sessions and one-shots that name none (default: the "
                                                "host's system directories)")
    image_store: str | None = Field(None, description="image cache directory (default: $TANGRAM_IMAGE_STORE, else "
                                                      "~/.local/share/arl-tangram/images)")
    registries: RegistriesConfig = Field(default_factory=RegistriesConfig, description="how images named by a "
                                         "registry reference are pulled on first use (the server config's "
                                         "[[registries]] tables and images.docker_config)")
    image_durable: bool = Field(True, description="layers synced to disk: an imported one before it becomes "
                                "visible, a pulled one behind its pull (the server config's images.durable)")
    image_max_gb: float | None = Field(None, gt=0, description="disk the image store may use (the server "
                                       "config's images.max_gb): past it, the least recently used images no "
                                       "sandbox uses are removed after a pull (default: no bound)")
    snapshot_dir: str | None = Field(None, description="where the server keeps the snapshots of POST "
                                                       "/v1/sessions/{id}/snapshot (default: beside its journal); on "
                                                       "Ray a path every node can read (a node's agent writes it). "
                                                       "Sessions moved off a draining node go through Ray's object "
                                                       "store instead")
    max_idle_sandboxes: int = Field(64, ge=0, description="hard cap on idle prepared sandboxes (warm pool plus "
                                                          "prewarmed image sandboxes; ~10 MB each). Set, it is "
                                                          "split among the sandbox workers; left to its default, "
                                                          "a server's sandbox workers raise it to the idle room "
                                                          "their one-shots circulate (three a scheduled core)")

    @model_validator(mode="after")
    def _pool_within_cap(self) -> "SandboxConfig":
        if self.warm_pool > self.max_idle_sandboxes:
            raise ValueError(f"warm_pool: {self.warm_pool} is above max_idle_sandboxes ({self.max_idle_sandboxes})")
        return self


@dataclass
class CommandResult:
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    truncated: bool = False
    timed_out: bool = False
    signal: int | None = None
    display: list[dict] = field(default_factory=list)  # python cells: the final expression's value
    error: list[dict] = field(default_factory=list)  # python cells: the exception raised, if any
    note: str = ""  # shell steps: the shell was restarted (and why)

    def __reduce__(self):  # field by field: pickled per one-shot on the links of a server (link.py)
        return by_fields(self)

    @classmethod
    def from_wire(cls, r: dict) -> "CommandResult":
        return cls(r.get("exit_code"), base64.b64decode(r.get("stdout", "")).decode("utf-8", "replace"),
                   base64.b64decode(r.get("stderr", "")).decode("utf-8", "replace"), r.get("duration_s", 0.0),
                   r.get("truncated", False), r.get("timed_out", False), r.get("signal"), r.get("display") or [],
                   r.get("raised") or [], r.get("note") or "")


def cut_files_note(paths: list[str]) -> str:
    """What a result says of fetched files cut at their size limit (``SandboxResult.info``'s
    ``cut_files``): in the native API's message, and in SandboxFusion's, which has no other field."""
    return "fetched files cut at their size limit: " + ", ".join(paths)


@dataclass
class SandboxResult:
    """What an action produced; ``message`` explains anything unusual (truncation, OOM, reset)."""

    run: CommandResult | None = None
    compile: CommandResult | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    message: str = ""
    info: dict = field(default_factory=dict)  # fork: the children; snapshot: the file and its size

    def __reduce__(self):  # field by field: pickled per one-shot on the links of a server (link.py)
        return by_fields(self)


@dataclass
class RunCode:
    """A one-shot program in a fresh sandbox."""

    code: str
    language: str = "python"
    stdin: bytes | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    fetch_files: list[str] = field(default_factory=list)
    compile_timeout_s: float = 10.0
    run_timeout_s: float = 10.0
    memory_mb: int | None = None
    image: str | None = None
    memory_as_rlimit: bool = False  # also cap address space: allocations fail (MemoryError) as in SandboxFusion

    def __reduce__(self):  # field by field: pickled per one-shot on the links of a server (link.py)
        return by_fields(self)


@dataclass
class Exec:
    """One step in a session: a shell ``command`` or a ``python`` cell in its interpreter."""

    command: str | None = None
    python: str | None = None
    stdin: bytes | None = None
    timeout_s: float = 10.0
    memory_mb: int | None = None
    image: str | None = None
    jupyter: bool = False  # a python cell's traceback goes only into its error record, as in a notebook


@dataclass
class Files:
    """Put files into a session's workspace and/or get files out of it."""

    put: dict[str, bytes] = field(default_factory=dict)
    get: list[str] = field(default_factory=list)
    image: str | None = None


FsKind = Literal["stat", "list", "mkdir", "remove", "move", "read", "write"]


@dataclass
class FsCall:
    """One filesystem call on a session's sandbox, by its absolute ``path`` inside the sandbox
    (anywhere the sandbox's code sees, not only the workspace): carried out by the sandbox's agent
    (``inside.fsops.op_fs``), never by the session's shell or interpreter, which its code can replace.
    ``result.info`` holds ``entry`` (stat, mkdir, move, write) or ``entries`` (list) as
    ``{path, mode, size, mtime, link}``; a read's bytes are ``result.files[path]``
    (``info["cut"]``: only the first ``max_bytes``). A failure that is the caller's is
    ``FAILED`` with ``info["error"]``: not_found, exists, denied, invalid or too_many."""

    call: FsKind
    path: str
    destination: str | None = None  # move
    depth: int = 1  # list
    data: bytes = b""  # write
    max_bytes: int = 1 << 24  # read
    image: str | None = None

    def request(self) -> dict:
        """The runner's request (``op_fs``)."""
        req: dict = {"op": "fs", "call": self.call, "path": self.path}
        if self.call == "move":
            req["destination"] = self.destination
        elif self.call == "list":
            req["depth"] = self.depth
        elif self.call == "write":
            req["data"] = base64.b64encode(self.data).decode()
        elif self.call == "read":
            req["max_bytes"] = self.max_bytes
        return req


@dataclass
class Fork:
    """Fork session ``source`` into new sessions ``children`` (ids chosen by the caller)."""

    source: str
    children: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Snapshot:
    """Write session ``source``'s filesystem state to ``path``."""

    source: str
    path: str


@dataclass
class Restore:
    """Make the new session of the action's trajectory from the snapshot at ``path`` (its files;
    its processes start on its first step)."""

    path: str
