"""The native v1 API: actions with job/trajectory identity and hints, sessions, outcomes that keep
infrastructure errors apart from the code's own failures."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Annotated

from ..core.names import MAX_MEMORY_MB, check_paths, check_text, image_problem

OutcomeName = Literal["ok", "failed", "timeout", "oom", "rejected", "cancelled", "infra_error"]


MAX_CPUS = 4096


def _cpu_range(v: tuple[int, int]) -> tuple[int, int]:
    """Checked where it enters, so a bad range is a 422 naming ``cpus``, never an engine fault."""
    lo, hi = v
    if lo < 1 or hi < lo or hi > MAX_CPUS:
        raise ValueError(f"need integers 1 <= min <= max <= {MAX_CPUS}, got [{lo}, {hi}]")
    return v


CpuRange = Annotated[tuple[int, int], AfterValidator(_cpu_range)]
def _image_name(v: str) -> str:
    problem = image_problem(v)
    if problem:
        raise ValueError(problem)
    return v


#: file names become paths in a sandbox: checked here (unchecked, a NUL byte is a 500 deep inside ``os``)
FileMap = Annotated[dict[str, str], AfterValidator(check_paths)]
FileList = Annotated[list[str], AfterValidator(check_paths)]
ImageName = Annotated[str, AfterValidator(_image_name)]
#: program text and stdin: a lone surrogate (JSON carries it, UTF-8 cannot) is a 422 naming the field
Text = Annotated[str, AfterValidator(check_text)]


class Request(BaseModel):
    """A request body of the native API: an unknown field is a 422 naming it (a misspelled
    ``timeout`` for ``timeout_s`` would be ignored, and the action run with the default)."""

    model_config = ConfigDict(extra="forbid")


class Hints(Request):
    """What the client knows: work in seconds at the minimum cores, how it scales, what it is."""

    work_s: Optional[float] = Field(None, ge=0, le=1e7)
    parallel_fraction: float = Field(0.0, ge=0, le=1)
    operation: str = Field("", max_length=128)
    remaining_turns: Optional[int] = Field(None, ge=0, le=1_000_000, description="actions the trajectory will "
                                           "still send after this one (lets the scheduler favour the step's "
                                           "last finishers)")


class RunCodeAction(Request):
    kind: Literal["run_code"] = "run_code"
    code: Text
    language: str = "python"
    stdin: Optional[Text] = None
    files: FileMap = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: FileList = Field(default_factory=list)
    compile_timeout_s: float = Field(10, gt=0, le=3600)
    timeout_s: float = Field(10, gt=0, le=3600)
    memory_mb: Optional[int] = Field(None, ge=16, le=MAX_MEMORY_MB)
    image: Optional[ImageName] = Field(None, description="image to run in (default: the server's sandbox.image): "
                                       "one in the server's store, or a registry reference, pulled on first use "
                                       "as part of the action")
    memory_as_rlimit: bool = Field(False, description="also cap the address space at memory_mb, so allocations "
                                                      "fail inside the program (python: MemoryError) instead of "
                                                      "an OOM kill; SandboxFusion's behaviour")


class ActionRequest(Request):
    """Submit an action. ``id`` is the idempotency key: submitting it again returns the same
    action and, once finished, the same result."""

    id: Optional[str] = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")
    job: str = Field("default", min_length=1, max_length=200)
    cpus: CpuRange = Field((1, 1), description="[min, max] cores; elastic when max > min")
    hints: Hints = Field(default_factory=Hints)
    wait: bool = Field(True, description="answer when the action has finished (else at once, with its id)")
    action: RunCodeAction


class CommandResult(BaseModel):
    exit_code: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    truncated: bool = False
    timed_out: bool = False


class ActionResult(BaseModel):
    id: str
    state: Literal["queued", "running", "done"]
    outcome: Optional[OutcomeName] = None
    message: str = ""
    run: Optional[CommandResult] = None
    compile: Optional[CommandResult] = None
    files: dict[str, str] = Field(default_factory=dict)
    act_s: Optional[float] = None
    queue_s: Optional[float] = None
    setup_s: Optional[float] = None
    exec_s: Optional[float] = None
    cores: Optional[int] = None
    woken: bool = Field(False, description="this session step woke the session from rest first")
    dropped: dict[str, str] = Field(default_factory=dict, description="woken: globals (and files) its state "
                                    "could not carry, each with why; they are missing now")


class SessionRequest(Request):
    job: str = Field("default", min_length=1, max_length=200)
    trajectory: Optional[str] = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$")
    image: Optional[ImageName] = Field(None, description="image the session's root comes from (default: the "
                                                          "server's): one in its store, or a registry reference, "
                                                          "pulled by the first step")
    restore: Optional[str] = Field(None, max_length=200, description="open the session from this snapshot "
                                   "(POST /v1/sessions/{id}/snapshot): its files; its processes start afresh")


class SessionInfo(BaseModel):
    session_id: str
    job: str
    image: Optional[str] = None


class SessionState(SessionInfo):
    """``GET /v1/sessions/{id}``: where the session's state is now."""

    state: Literal["new", "running", "awake", "resting", "at_rest", "pending"] = Field(
        ..., description="new: no step yet; running: a step runs; awake: idle, processes kept (frozen); resting: "
                         "being put to rest; at_rest: its state on disk, no processes (the next step wakes it); "
                         "pending: files ready, processes start on the next step")


class ForkRequest(Request):
    n: int = Field(..., ge=1, le=256, description="children to make")


class ForkResult(BaseModel):
    """The children share the source's files copy-on-write; processes (shell, python) restart."""

    outcome: OutcomeName
    message: str = ""
    session_ids: list[str] = Field(default_factory=list)
    fork_s: Optional[float] = None


class SnapshotInfo(BaseModel):
    """A snapshot of a session's files, kept by the server until deleted (``GET /v1/snapshots``)."""

    snapshot: str = Field(..., description="its id: POST /v1/sessions with {\"restore\": id} opens a session from it")
    bytes: int
    session_id: Optional[str] = Field(None, description="the session it was taken of")
    job: Optional[str] = None
    image: Optional[str] = Field(None, description="the image under its files (none: the host's directories)")
    created: Optional[float] = Field(None, description="Unix time")


class ImageInfo(BaseModel):
    """An image of the server's store (``tangram image import`` or ``pull``, or pulled on first use)."""

    name: str
    id: str
    size_bytes: int
    created: float
    layers: int


class PrewarmRequest(Request):
    image: ImageName
    n: int = Field(..., ge=1, le=4096, description="sandboxes to have ready")
    nodes: Optional[int] = Field(None, ge=1, le=4096, description="on Ray: pull the image and start n sandboxes "
                                 "on each of this many nodes, those holding the image first (default one)")


class PrewarmResult(BaseModel):
    image: str
    requested: int
    ready: int = Field(..., description="started by this request")
    idle_total: int = Field(..., description="idle sandboxes now, all images")
    cap: int = Field(..., description="sandbox.max_idle_sandboxes")
    message: str = ""


class ExecRequest(Request):
    command: Optional[Text] = None
    python: Optional[Text] = None
    stdin: Optional[Text] = None
    timeout_s: float = Field(10, gt=0, le=3600)
    cpus: CpuRange = Field((1, 1), description="[min, max] cores; elastic when max > min")
    hints: Hints = Field(default_factory=Hints)


class PutFiles(Request):
    files: FileMap = Field(..., description="path -> base64 content")


class GotFiles(BaseModel):
    files: dict[str, str]
    missing: list[str]


def _absolute(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise ValueError("an absolute path without NUL bytes is expected")
    return path


AbsolutePath = Annotated[str, AfterValidator(check_text), AfterValidator(_absolute)]


class FsRequest(Request):
    """One filesystem call anywhere in the session's sandbox, as its own commands see it, carried
    out by the sandbox's agent (never by the session's shell or interpreter, whose code its user
    can replace); only regular files are read or written, and nothing under /proc or /sys."""

    call: Literal["stat", "list", "mkdir", "remove", "move", "read", "write"]
    path: AbsolutePath = Field(..., max_length=4096)
    destination: Optional[AbsolutePath] = Field(None, max_length=4096, description="move: where to")
    depth: int = Field(1, ge=1, le=1000, description="list: levels below path")
    data: str = Field("", description="write: base64 content")
    max_bytes: int = Field(1 << 24, ge=0, le=1 << 24, description="read: the most bytes answered (cut: more there)")

    @model_validator(mode="after")
    def _destination(self) -> "FsRequest":
        if self.call == "move" and self.destination is None:
            raise ValueError("destination: required to move")
        return self


class FsEntry(BaseModel):
    path: str
    mode: int = Field(..., description="st_mode (of what a link points to, when it can be reached)")
    size: int
    mtime: float
    link: Optional[str] = Field(None, description="a link's target")


class FsResult(BaseModel):
    entry: Optional[FsEntry] = None
    entries: Optional[list[FsEntry]] = None
    data: Optional[str] = Field(None, description="read: base64 content")
    cut: bool = False


class JobStats(BaseModel):
    job: str
    actions: int
    outcomes: dict[str, int]
    avg_act_s: Optional[float] = None
    p50_act_s: Optional[float] = None
    p99_act_s: Optional[float] = None


class Error(BaseModel):
    message: str


class ModelRequest(Request):
    tokens: list[int] = Field(..., description="token ids of one sequence")
    job: str = Field("default", min_length=1, max_length=200)
    hint_s: Optional[float] = Field(None, ge=0)


class ModelResult(BaseModel):
    outcome: OutcomeName
    message: str = ""
    value: Optional[float | list[float]] = None
    act_s: float = 0.0


class ClusterNode(BaseModel):
    """One node the engine schedules: its capacity, health and what runs there now."""

    id: str
    name: str
    address: str
    state: Literal["starting", "alive", "draining", "drained", "dead"] = Field(
        ..., description="draining: takes no new work, its sessions are moving off (POST .../drain); drained: it "
                         "holds nothing")
    cores: int
    cores_free: int
    gpus: int = 0
    islands: list[list[int]] = Field(default_factory=list, description="GPU ids per NVLink island")
    memory_gb: Optional[float] = None
    sandboxes: bool = Field(..., description="whether the node runs sandboxes (isolation available)")
    isolation: Optional[str] = None
    cgroups: Optional[str] = None
    problem: str = Field("", description="why the node serves no sandboxes, if it does not")
    running: list[str] = Field(default_factory=list, description="ids of the actions running there")
    sessions: int = 0


class ClusterInfo(BaseModel):
    backend: Literal["local", "ray"]
    nodes: list[ClusterNode]
    moves: Optional[int] = Field(None, description="sessions carried to another node since the start (a drain, a "
                                                    "node lost, or for balance); null without nodes to move between")
    move_p50_s: Optional[float] = Field(None, description="how long the last 4,096 of those moves took, p50 (what a "
                                                          "step waiting for its session's move waited)")
    move_max_s: Optional[float] = Field(None, description="the longest of those")
    move_price_s: Optional[float] = Field(None, description="what the policy weighs a move for balance at now: the "
                                                            "config's move_s, or the p50 of what the last 16 moves cost "
                                                            "whole (the carry, then the session's wake on its new "
                                                            "node) where that is more (a session moves only to skip "
                                                            "a longer wait)")

