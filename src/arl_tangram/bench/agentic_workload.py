"""The seeded GRPO-style step ``tangram bench agentic`` runs: plain data, no I/O.

G groups of K trajectories. A group is one task (a repository with its test suite, a domain whose
teacher scores it); its K trajectories are K samples of the policy on it, so they share the task's
test size and teacher and differ in turn count, commands and sampled lengths. Each turn:

* the policy's generation: a wait drawn lognormal with ``code_agent``'s shape (sim/workloads.py:
  sigma 0.8, clamped), its median scaled to the run (the policy model runs on the training
  cluster, outside the measured resources);
* one or two sandbox steps in the trajectory's session: a shell command or a file edit, and with
  probability ``test_p`` a test run: CPU-bound Python that does a serial part (collection), then
  runs the rest in units over as many processes as its sandbox has CPUs, so its declared
  ``parallel_fraction`` is what the program really does (Amdahl's law is what the simulator
  assumes);
* a teacher's log-probabilities of the turn's tokens (on-policy distillation) from the teacher of
  their domain, one of several of different sizes: the group's own teacher half the time, another
  one otherwise (a task's turns touch other domains too).

After the last turn: the reward model's score of the whole trajectory and one call to a judge API
behind a quota. Every action of a trajectory runs after the previous one ended, which is the trace
format's model of a trajectory (sim/workload.py), so a recorded run replays action for action.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

#: loop iterations of one unit of test work (about 20-30 ms of one core in CPython)
UNIT_ITERATIONS = 400_000

#: a test run: ``serial`` units on one process (collection), then ``parallel`` units of one each,
#: as many at a time as the sandbox has CPUs now. Its CPU set is read before every unit, so a run
#: that is given cores while it runs (Tangram's ``Grow``) uses them and one whose cores are taken
#: back (``Shrink``) stops using them, as a ``pytest -n auto`` that rereads its CPUs would.
TEST = """
import os
serial, parallel = {serial}, {parallel}
def work(k):
    s = 0
    for i in range(k * {unit}):
        s += i * i
    return s
work(serial)
left, running = parallel, set()
while left or running:
    n = max(1, len(os.sched_getaffinity(0)))
    while left and len(running) < n:
        pid = os.fork()
        if pid == 0:
            work(1)
            os._exit(0)
        running.add(pid)
        left -= 1
    running.discard(os.wait()[0])
print("passed", serial + parallel)
"""

SHELL = (
    "ls -la /workspace > /dev/null && echo ok",
    "grep -c def src.py 2>/dev/null || echo 0",
    "cat /etc/hostname 2>/dev/null; echo $((6 * 7))",
    "python3 -c 'print(sum(range(200000)))'",
)

EDITS = (
    "printf 'def f(x):\\n    return x * {n}\\n' > src.py && grep -c def src.py",
    "printf 'def g(y):\\n    return y + {n}\\n' >> src.py && wc -l < src.py",
    "sed -i 's/return x \\* [0-9]*/return x * {n}/' src.py 2>/dev/null; echo edited",
)


@dataclass(frozen=True)
class Teacher:
    """A teacher (``logprobs``) or the reward model (``score``): a random-weight model of
    ``managers/models/tiny.py``, ``billions`` parameters on CUDA, ``d_model`` wide on CPU."""

    name: str
    billions: float
    d_model: int
    op: str = "logprobs"


@dataclass(frozen=True)
class Sizes:
    """What a CPU run and a GPU host's run differ in."""

    gen_median_s: float
    gen_lo_s: float
    gen_hi_s: float
    turns: int
    test_p: float
    test_s: tuple[float, float]  # a group's test suite, seconds of one core (drawn per group)
    serial_fraction: float
    teacher_tokens: int  # median tokens a turn's teacher call scores
    reward_tokens: int
    vocab: int
    judge_rate_per_s: float
    judge_concurrency: int
    judge_median_s: float
    teachers: tuple[Teacher, ...]
    reward: Teacher
    gen_sigma: float = 0.8


CPU = Sizes(gen_median_s=1.0, gen_lo_s=0.1, gen_hi_s=4.0, turns=3, test_p=0.5, test_s=(0.5, 1.0),
            serial_fraction=0.1, teacher_tokens=48, reward_tokens=96, vocab=512, judge_rate_per_s=1.0,
            judge_concurrency=1, judge_median_s=0.2,
            teachers=(Teacher("teacher-s", 0.0, 32), Teacher("teacher-m", 0.0, 64), Teacher("teacher-l", 0.0, 96)),
            reward=Teacher("reward", 0.0, 64, "score"))

GPU = Sizes(gen_median_s=3.0, gen_lo_s=0.3, gen_hi_s=15.0, turns=5, test_p=0.5, test_s=(1.6, 3.2),
            serial_fraction=0.1, teacher_tokens=512, reward_tokens=2048, vocab=32000, judge_rate_per_s=2.0,
            judge_concurrency=2, judge_median_s=0.4,
            teachers=(Teacher("teacher-0.5b", 0.5, 0), Teacher("teacher-1b", 1.0, 0), Teacher("teacher-1.5b", 1.5, 0),
                      Teacher("teacher-3b", 3.0, 0)),
            reward=Teacher("reward-0.5b", 0.5, 0, "score"))

SIZES = {"cpu": CPU, "cuda": GPU}


@dataclass(frozen=True)
class Step:
    """One action: ``kind`` is shell, edit, test (a sandbox step: ``command``, ``cores`` its
    demand, ``parallel_fraction``), teacher or reward (``model``, ``tokens``) or judge
    (``service_s``: how long the API takes to answer); ``wait_s`` is the policy's generation
    before it (0 for the actions after the first of a turn)."""

    kind: str
    wait_s: float = 0.0
    command: str = ""
    cores: tuple[int, int] = (1, 1)
    parallel_fraction: float = 0.0
    model: str = ""
    tokens: tuple[int, ...] = ()
    service_s: float = 0.0

    @property
    def pool(self) -> str:
        return "cpu" if self.kind in ("shell", "edit", "test") else "api" if self.kind == "judge" else "gpu"


@dataclass(frozen=True)
class Trajectory:
    id: str
    group: int
    teacher: str
    steps: tuple[Step, ...] = field(default_factory=tuple)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, rng.lognormvariate(math.log(median), sigma)))


def _tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab) for _ in range(n))


#: prints the seconds of one unit of test work in the interpreter the sandboxes run (best of 3)
CALIBRATE = """
import time
def work(k):
    s = 0
    for i in range(k * {unit}):
        s += i * i
    return s
best = None
for _ in range(3):
    t = time.perf_counter()
    work(3)
    d = (time.perf_counter() - t) / 3
    best = d if best is None else min(best, d)
print(best)
""".format(unit=UNIT_ITERATIONS)


def test_command(units: int, serial_fraction: float) -> tuple[str, float]:
    """The shell command of a test run of ``units`` and its parallel fraction."""
    serial = max(1, round(units * serial_fraction))
    parallel = max(1, units - serial)
    code = TEST.format(serial=serial, parallel=parallel, unit=UNIT_ITERATIONS)
    return f"python3 -c '{code}'", parallel / (serial + parallel)


def plan(groups: int, k: int, seed: int, sizes: Sizes, max_cores: int, unit_s: float,
         turns: int | None = None) -> list[Trajectory]:
    """The step's ``groups`` x ``k`` trajectories, deterministic for ``seed`` and ``unit_s`` (one
    unit of test work on one core here: ``calibrate``; test sizes are planned in seconds). A test
    run may use up to ``max_cores`` (the machine's sandbox cores)."""
    if groups < 1 or k < 1:
        raise ValueError(f"groups, k: need at least 1 each, got {groups} and {k}")
    if max_cores < 1:
        raise ValueError(f"max_cores: need at least 1, got {max_cores}")
    if not unit_s > 0:
        raise ValueError(f"unit_s: must be positive, got {unit_s}")
    rng = random.Random(seed)
    base_turns = turns or sizes.turns
    out = []
    for g in range(groups):
        teacher = sizes.teachers[g % len(sizes.teachers)].name
        task_s = rng.uniform(*sizes.test_s)
        for j in range(k):
            n_turns = max(1, base_turns + rng.randint(-1, 1))
            steps: list[Step] = []
            for _ in range(n_turns):
                wait = _lognormal(rng, sizes.gen_median_s, sizes.gen_sigma, sizes.gen_lo_s, sizes.gen_hi_s)
                if rng.random() < 0.5:
                    steps.append(Step("shell", wait, rng.choice(SHELL)))
                else:
                    steps.append(Step("edit", wait, rng.choice(EDITS).format(n=rng.randint(2, 9))))
                if rng.random() < sizes.test_p:
                    units = max(2, round(task_s * rng.uniform(0.7, 1.3) / unit_s))
                    cmd, pf = test_command(units, sizes.serial_fraction)
                    steps.append(Step("test", 0.0, cmd, (1, max_cores), pf))
                n_tok = max(2, round(_lognormal(rng, sizes.teacher_tokens, 0.5, 8, 4 * sizes.teacher_tokens)))
                domain = teacher if rng.random() < 0.5 else rng.choice(sizes.teachers).name
                steps.append(Step("teacher", 0.0, model=domain, tokens=_tokens(rng, n_tok, sizes.vocab)))
            steps.append(Step("reward", 0.0, model=sizes.reward.name,
                              tokens=_tokens(rng, sizes.reward_tokens, sizes.vocab)))
            steps.append(Step("judge", 0.0, service_s=_lognormal(rng, sizes.judge_median_s, 0.5,
                                                                 sizes.judge_median_s / 4, sizes.judge_median_s * 4)))
            out.append(Trajectory(f"g{g}k{j}", g, teacher, tuple(steps)))
    return out


def describe(trajs: list[Trajectory]) -> dict:
    """What the plan holds, for the report."""
    kinds: dict[str, int] = {}
    for t in trajs:
        for s in t.steps:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {"trajectories": len(trajs), "actions": sum(kinds.values()), "by_kind": kinds,
            "generation_s": round(sum(s.wait_s for t in trajs for s in t.steps), 3)}
