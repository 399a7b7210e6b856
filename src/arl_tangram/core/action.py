"""Actions, their demands, allocations and outcomes: the vocabulary every layer shares."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any, Final, Mapping

from mypy_extensions import mypyc_attr

# ``Final``: compiled (``setup.py``), a constant is built in instead of read from the module's
# dict at every use
#: resource kinds a demand may name; API quotas are implied by an ``api:<name>`` service.
CPU: Final = "cpu"
GPU: Final = "gpu"
RESOURCE_KINDS: Final = (CPU, GPU)

SANDBOX: Final = "sandbox"
MODEL_PREFIX: Final = "model:"
API_PREFIX: Final = "api:"


class Outcome(str, enum.Enum):
    """Exactly one terminal outcome per accepted action (docs/design.md, "Concepts").

    ``failed`` is the user's code failing (a result); ``infra_error`` is ours and retryable, never
    to be turned into a score.
    """

    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    OOM = "oom"
    REJECTED = "rejected"
    CANCELLED = "cancelled"
    INFRA_ERROR = "infra_error"

    def __str__(self) -> str:
        """``ok``, as the HTTP API and the docs spell it (``print(r.outcome)`` said ``Outcome.OK``)."""
        return self.value


class InvalidAction(ValueError):
    """An action that can never run as described; ``field`` names the offending field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


def by_fields(record: Any) -> tuple[Any, tuple[Any, ...]]:
    """``__reduce__`` of the records built on the hot path: rebuilt by ``__init__`` from their
    fields in order (pickle's default needs a ``__dict__``, which a compiled record lacks).

    Why their ``__init__``s are written out: ``@dataclass`` generates one as Python source even in
    a compiled module (``setup.py``), ~0.3 µs a record; written out it compiles, ~0.1 µs (timeit),
    and an action passes through six of them. They are still dataclasses (repr, eq, ``fields``,
    ``replace``). Not frozen: a frozen dataclass's ``__init__`` costs ~3x.

    ``mypyc_attr(free_list_len=1)`` on each: compiled, one freed instance is reused for the next.
    ``acyclic=True`` (the garbage collector does not track them) only on ``Demand`` and
    ``Allocation``, which hold ints, strings and tuples of them: the others hold the caller's
    objects (an action's ``payload``, a completion's ``result``), and a cycle through an untracked
    record would never be freed. Acyclic on all six measured the same as on these two
    (alternating runs of ``tangram bench scheduler``); with the free lists, 1.05x. As plain Python
    the decorator does nothing.
    """
    kind = type(record)
    known = _FIELD_GETTERS.get(kind)
    if known is None:
        names = [f.name for f in fields(record)]
        known = _FIELD_GETTERS[kind] = (attrgetter(*names), len(names) == 1)
    values = known[0](record)
    return kind, ((values,) if known[1] else values)


#: per record class, one getter of all its fields in order and whether it has only one (then it
#: returns the value, not a tuple): ``dataclasses.fields`` builds its tuple anew at every call,
#: a third of a record's pickling (``by_fields``) otherwise
_FIELD_GETTERS: dict[type, tuple[Any, bool]] = {}


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(init=False)
class Demand:
    """Per resource kind an inclusive ``(min, max)`` range of units; elastic when max > min.
    Treated as immutable (nothing assigns to it once built; ``Action`` replaces it whole)."""

    ranges: dict[str, tuple[int, int]]  # a dict, not any Mapping: compiled, read without a method call

    def __init__(self, ranges: Mapping[str, Any] | None = None) -> None:
        # One is built per request, so the common shape (a tuple of two ints) is checked with
        # type tests only; anything else (lists from JSON, floats, bad values) takes the full check
        # below and, when valid, is stored as a tuple of two ints, the type the field declares.
        # (The full check for every range cost 0.08 µs more a build, timeit.)
        given: dict[str, Any] = ranges if type(ranges) is dict else dict(ranges or {})
        self.ranges = given
        odd: dict[str, tuple[int, int]] | None = None
        for kind, rng in given.items():
            if kind in RESOURCE_KINDS and type(rng) is tuple and len(rng) == 2:
                lo, hi = rng
                if type(lo) is int and type(hi) is int and 1 <= lo <= hi:
                    continue
            if odd is None:
                odd = {}
            odd[kind] = _check_range(kind, rng)
        if odd is not None:
            self.ranges = {**given, **odd}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)

    @classmethod
    def of(cls, **ranges: int | tuple[int, int]) -> "Demand":
        """``Demand.of(cpu=(1, 8))`` or ``Demand.of(gpu=2)`` (a fixed amount)."""
        return cls({k: (v, v) if isinstance(v, int) else (int(v[0]), int(v[1])) for k, v in ranges.items()})

    def get(self, kind: str) -> tuple[int, int] | None:
        return self.ranges.get(kind)

    def min(self, kind: str) -> int:
        rng = self.ranges.get(kind)
        return rng[0] if rng else 0

    def max(self, kind: str) -> int:
        rng = self.ranges.get(kind)
        return rng[1] if rng else 0


def _check_range(kind: str, rng: Any) -> tuple[int, int]:
    """``rng`` as a ``(min, max)`` tuple of ints, or ``InvalidAction`` naming ``demand.<kind>``."""
    if kind not in RESOURCE_KINDS:
        raise InvalidAction(f"demand.{kind}", f"unknown resource kind (known: {', '.join(RESOURCE_KINDS)})")
    if len(rng) != 2:
        raise InvalidAction(f"demand.{kind}", "must be a [min, max] pair")
    lo, hi = rng
    if int(lo) != lo or int(hi) != hi or lo < 1 or hi < lo:
        raise InvalidAction(f"demand.{kind}", f"need integers 1 <= min <= max, got [{lo}, {hi}]")
    return int(lo), int(hi)


def seconds(field: str, value: Any) -> Any:
    """A caller's number of seconds for ``field``: None, an int or a float as it is, another real
    number (a numpy scalar) as a float; anything else ``InvalidAction`` naming ``field``."""
    if value is None or type(value) is float or type(value) is int:
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    raise InvalidAction(field, f"must be a number of seconds, got {value!r}")


def _count(field: str, value: Any) -> int:
    """A count given as another real number than an int (2.0, a numpy int), as the int it equals;
    anything else ``InvalidAction`` naming ``field``."""
    if isinstance(value, numbers.Real) and (whole := float(value)).is_integer():
        return int(whole)
    raise InvalidAction(field, f"must be an integer >= 0, got {value!r}")


def pool_of(service: str) -> str:
    """The pool an action of ``service`` draws from: ``cpu``, ``gpu`` or ``api:<name>``."""
    if service == SANDBOX:
        return CPU
    if service.startswith(MODEL_PREFIX) and len(service) > len(MODEL_PREFIX):
        return GPU
    if service.startswith(API_PREFIX) and len(service) > len(API_PREFIX):
        return service
    raise InvalidAction("service", f"unknown service {service!r} (expected 'sandbox', 'model:<name>' or 'api:<name>')")


@dataclass(init=False, eq=False)
class Action:
    """One external call of a rollout, scheduled on its own.

    ``hint_s`` is the client's guess of the work in seconds at the minimum demand (a prior for the
    predictor, never trusted blindly); ``parallel_fraction`` or ``speedup`` describe how the work
    shrinks with more units (``speedup[i]`` is the speed-up at ``min + i`` units, ``speedup[0] == 1``).
    ``remaining_turns`` is the client's count of actions its trajectory will still send after this
    one (0: the last); the policy learns it per job when absent.
    """

    id: str
    service: str
    demand: Demand
    job: str
    trajectory: str | None
    step: int | None
    operation: str
    hint_s: float | None
    parallel_fraction: float
    speedup: tuple[float, ...] | None
    weights_gb: float
    timeout_s: float | None
    payload: Any
    submitted_at: float
    pool: str  # set from ``service``; the argument is ignored (kept for ``replace`` and pickle)
    remaining_turns: int | None

    def __init__(self, id: str, service: str, demand: Demand | None = None, job: str = "default",
                 trajectory: str | None = None, step: int | None = None, operation: str = "",
                 hint_s: Any = None, parallel_fraction: float = 0.0,
                 speedup: tuple[float, ...] | None = None, weights_gb: float = 0.0,
                 timeout_s: Any = None, payload: Any = None, submitted_at: float = 0.0,
                 pool: str = "", remaining_turns: Any = None) -> None:
        # ``hint_s``, ``timeout_s`` and ``remaining_turns`` take any real number (numpy scalars,
        # 2.0 turns: an RL loop's counters), checked here so that anything else names its field:
        # compiled, an argument of another type than the one declared is a bare ``TypeError``
        if hint_s is not None and type(hint_s) is not float:
            hint_s = seconds("hint_s", hint_s)
        if timeout_s is not None and type(timeout_s) is not float:
            timeout_s = seconds("timeout_s", timeout_s)
        if remaining_turns is not None and type(remaining_turns) is not int:
            remaining_turns = _count("remaining_turns", remaining_turns)
        self.id = id
        self.service = service
        self.job = job
        self.trajectory = trajectory
        self.step = step
        self.operation = operation
        self.hint_s = hint_s
        self.parallel_fraction = parallel_fraction
        self.speedup = speedup
        self.weights_gb = weights_gb
        self.timeout_s = timeout_s
        self.payload = payload
        self.submitted_at = submitted_at
        if not id:
            raise InvalidAction("id", "must be a non-empty string")
        # one is built per request: the common service is compared before ``pool_of`` is called
        pool = self.pool = CPU if service == SANDBOX else pool_of(service)
        if demand is None:
            demand = Demand()
        if (pool == CPU or pool == GPU) and pool not in demand.ranges:  # a pool's kind names its unit
            demand = Demand({**demand.ranges, pool: (1, 1)})
        self.demand = demand
        if not 0.0 <= self.parallel_fraction <= 1.0:
            raise InvalidAction("parallel_fraction", f"must lie in [0, 1], got {self.parallel_fraction}")
        if self.hint_s is not None and self.hint_s < 0:
            raise InvalidAction("hint_s", f"must be >= 0, got {self.hint_s}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise InvalidAction("timeout_s", f"must be > 0, got {self.timeout_s}")
        if remaining_turns is not None and remaining_turns < 0:
            raise InvalidAction("remaining_turns", f"must be an integer >= 0, got {remaining_turns}")
        self.remaining_turns = remaining_turns
        if self.weights_gb < 0:
            raise InvalidAction("weights_gb", f"must be >= 0, got {self.weights_gb}")
        if self.speedup is not None:
            lo, hi = self.demand.get(self.units_kind) or (1, 1)
            if len(self.speedup) != hi - lo + 1 or abs(self.speedup[0] - 1.0) > 1e-9:
                raise InvalidAction("speedup", f"needs {hi - lo + 1} entries (min..max units) starting at 1.0")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)

    @property
    def units_kind(self) -> str:
        """The kind of unit this action is allocated in (``cpu`` or ``gpu``; quota slots for APIs)."""
        return GPU if self.pool == GPU else CPU

    @property
    def model(self) -> str | None:
        return self.service[len(MODEL_PREFIX):] if self.pool == GPU else None

    def speed_factor(self, units: int) -> float:
        """Execution time at ``units`` relative to the time at the minimum demand (<= 1)."""
        lo, hi = self.demand.get(self.units_kind) or (1, 1)
        if units <= lo:
            return 1.0
        units = min(units, hi)
        if self.speedup is not None:
            return 1.0 / self.speedup[units - lo]
        p = self.parallel_fraction
        return (1.0 - p) + p * lo / units


class Setup(str, enum.Enum):
    """The state work a manager does before an action runs."""

    NONE = ""  # nothing: a one-shot, or a session whose sandbox is already thawed for it
    CREATE = "create"  # a new session's sandbox
    THAW = "thaw"  # a frozen session's sandbox, on the node that holds it
    RESTORE = "restore"  # a session moved: its state is brought to the new node
    LOAD = "load"  # a model's weights copied host -> GPU


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(init=False)  # ``__init__`` written out: ``by_fields``
class Allocation:
    """Where and with what an action runs: ``units`` are core ids (cpu) or global GPU ids (gpu).

    ``setup`` names the state work the manager does first; ``evict`` lists model instances (model, gpu ids) dropped from GPU memory to make room;
    ``reservation`` names the static partition the units came from; ``unmanaged`` API calls were
    not admitted against our quota (the client-side practice of the static baseline); ``share`` is
    the fraction of each GPU's compute the action was given (other actions may share the rest).
    """

    pool: str
    node: int | None
    units: tuple[int, ...]
    setup: Setup
    evict: tuple[tuple[str, tuple[int, ...]], ...]
    reservation: str
    unmanaged: bool
    share: float

    def __init__(self, pool: str, node: int | None = None, units: tuple[int, ...] = (), setup: Setup = Setup.NONE,
                 evict: tuple[tuple[str, tuple[int, ...]], ...] = (), reservation: str = "",
                 unmanaged: bool = False, share: float = 1.0) -> None:
        self.pool = pool
        self.node = node
        self.units = units
        self.setup = setup
        self.evict = evict
        self.reservation = reservation
        self.unmanaged = unmanaged
        self.share = share

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)

    @property
    def count(self) -> int:
        return len(self.units) if self.units else 1


@mypyc_attr(free_list_len=1)
@dataclass(init=False)  # ``__init__`` written out: ``by_fields``
class Finished:
    """The record of one action's terminal outcome, with the timings ACT is made of."""

    action: Action
    outcome: Outcome
    submitted_at: float
    started_at: float | None
    finished_at: float
    setup_s: float
    exec_s: float
    units: int
    message: str

    def __init__(self, action: Action, outcome: Outcome, submitted_at: float, started_at: float | None,
                 finished_at: float, setup_s: float = 0.0, exec_s: float = 0.0, units: int = 0,
                 message: str = "") -> None:
        self.action = action
        self.outcome = outcome
        self.submitted_at = submitted_at
        self.started_at = started_at
        self.finished_at = finished_at
        self.setup_s = setup_s
        self.exec_s = exec_s
        self.units = units
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)

    @property
    def act_s(self) -> float:
        return self.finished_at - self.submitted_at

    @property
    def queue_s(self) -> float:
        return (self.started_at if self.started_at is not None else self.finished_at) - self.submitted_at
