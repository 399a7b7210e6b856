"""Property tests: whatever arrives, in whatever order, no allocation exceeds capacity and every
accepted action ends exactly once (under every policy)."""

from collections import Counter

from hypothesis import HealthCheck, example, given, settings, strategies as st

from arl_tangram.core import Action, ApiQuota, Demand, ModelSpec, Outcome
from arl_tangram.core.cluster import Cluster, CpuNode, GpuNode
from arl_tangram.policy import Costs, InfeasiblePolicy, Profile, make_policy, tangram_policy

from conftest import Chaining, Harness

#: "tangram-eager" grows without waiting for a quiet pool, so that its grown actions meet queues
#: and are shrunk (``Shrink``) often, where the default Tangram rarely grows in a short script
POLICIES = ["tangram", "tangram-eager", "fifo", "task-isolated", "trajectory-static"]


def policy_named(name: str):
    return tangram_policy(elastic_quiet_s=0.0) if name == "tangram-eager" else make_policy(name)


@st.composite
def clusters(draw):
    cpu = tuple(CpuNode(f"c{i}", draw(st.integers(1, 6)), draw(st.sampled_from([1.0, 4.0, 64.0])))
                for i in range(draw(st.integers(1, 3))))
    gpus = draw(st.sampled_from([0, 1, 2, 4]))
    gnodes = ()
    models = ()
    if gpus:
        island = draw(st.sampled_from([s for s in (1, 2, 4) if s <= gpus and gpus % s == 0]))
        mem = draw(st.sampled_from([20.0, 80.0]))
        gnodes = (GpuNode("g0", gpus, mem, island, 25.0),)
        models = tuple(ModelSpec(f"m{i}", draw(st.sampled_from([5.0, 15.0, 30.0])) * g, g,
                                 compute_share=draw(st.sampled_from([1.0, 1.0, 0.5, 0.3])))
                       for i, g in enumerate(draw(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=3)))
                       if g <= island and 5.0 * g / g <= mem)
        models = tuple(m for m in models if m.per_gpu_gb() <= mem)
    quotas = (ApiQuota("q", draw(st.sampled_from([0.5, 5.0])), draw(st.integers(1, 3))),) if draw(st.booleans()) \
        else ()
    return Cluster(cpu, gnodes, quotas, models)


ops = st.lists(st.tuples(st.sampled_from(["submit", "submit", "submit", "complete", "advance", "end", "cancel"]),
                         st.integers(0, 10_000)), min_size=1, max_size=60)


def check_invariants(engine) -> None:
    cpu = engine.cpu
    seen_cores = set()
    for run in engine.running.values():
        alloc = run.allocation
        if alloc.pool == "cpu":
            for c in alloc.units:
                assert (alloc.node, c) not in seen_cores, "a core given to two actions"
                seen_cores.add((alloc.node, c))
                assert 0 <= c < cpu.nodes[alloc.node].cores
    for res in engine.reservations.values():
        if res.pool == "cpu":
            for c in res.free:
                assert (res.node, c) not in seen_cores
    for i, node in enumerate(cpu.nodes):
        assert 0 <= cpu.nfree(i) <= node.cores
        assert len(set(cpu.free_cores[i])) == cpu.nfree(i)
        assert cpu.free_mem[i] >= -1e-9
        for c in cpu.free_cores[i]:
            assert (i, c) not in seen_cores, "a core both free and in use"
    assert cpu.total_free == sum(cpu.nfree(i) for i in range(len(cpu.nodes)))
    shares = Counter()
    copies = Counter()
    for run in engine.running.values():
        if run.allocation.pool == "gpu":
            copies[id(run.instance)] += 1
            for g in run.allocation.units:
                shares[g] += run.allocation.share
                assert run.action.id in engine.gpu.gpus[g].occupants
    for key, load in engine.loading.items():
        copies[id(load.instance)] += 1
        for g in load.block:
            shares[g] += engine.cluster.model(load.model).compute_share  # a load holds its model's share
    assert all(v <= 1.0 + 1e-9 for v in shares.values()), "a GPU's compute given out more than once"
    assert all(v == 1 for v in copies.values()), "a model copy running two batches"
    for i, gpu in enumerate(engine.gpu.gpus):
        assert abs(gpu.share_used - shares.get(i, 0.0)) < 1e-9
    live = [g for g in engine.gpu.gpus if g.alive]  # GPUs of nodes that left count nowhere
    assert engine.gpu.capacity == len(live)
    assert engine.gpu.total_free == sum(1 for g in live if not g.occupants)
    assert engine.gpu.spare_gpus == sum(1 for g in live if g.share_used < 1 - 1e-9)
    for g in engine.gpu.gpus:
        assert g.used_gb <= g.memory_gb + 1e-9, "GPU memory oversubscribed"
    for q in engine.quotas.values():
        assert 0 <= q.in_use <= q.quota.concurrency


def check_fair_share_ledger(engine) -> None:
    """What an action-level policy counts per job for its fair share is what the job's running
    actions hold: cores charged at a start and a grow come back at a shrink and at the end."""
    units = getattr(engine.policy, "job_units", None)
    if units is None:
        return
    held = Counter()
    for run in engine.running.values():
        if run.allocation.pool == "cpu":
            held[run.action.job] += len(run.allocation.units)
    assert {j: u.get("cpu", 0) for j, u in units.items() if u.get("cpu", 0)} == dict(held)


def check_home_queues(engine) -> None:
    """The action-level policy's count of the cores each node's sessions wait for (what a move
    there would jump) is the sum of the waiting steps it counted, every one of them still waiting:
    a started or cancelled step leaves no count behind."""
    counted = getattr(engine.policy, "_queued_on", None)
    if counted is None:
        return
    assert set(counted) <= set(engine.pending), "a step counted as waiting that no longer waits"
    per_node = Counter()
    for aid, node in counted.items():
        per_node[node] += engine.pending[aid].demand.min("cpu")
    queues = engine.policy._home_queue
    assert {n: c for n, c in enumerate(queues) if c} == dict(per_node)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), policy=st.sampled_from(POLICIES), script=ops)
# found by CI: trajectory t0 ends while its action runs, t1 takes the node's only session memory,
# and t0 comes back while its sandbox is still reserved (trajectory-static started it: CapacityError)
@example(cluster=Cluster(cpu_nodes=(CpuNode("c0", 6, 1.0),)), policy="trajectory-static",
         script=[("submit", 444), ("submit", 1), ("end", 0), ("submit", 188)])
def test_capacity_is_never_exceeded_and_every_action_ends_once(cluster, policy, script):
    services = ["sandbox"] + [f"model:{m.name}" for m in cluster.models] + [f"api:{q.name}" for q in cluster.quotas]
    profile = Profile(trajectories=3)
    try:
        h = Harness(cluster, policy_named(policy), costs=Costs(session_mem_gb=1.0), profile=profile)
    except InfeasiblePolicy:
        return
    accepted: list[str] = []
    for n, (op, x) in enumerate(script):
        if op == "submit":
            service = services[x % len(services)]
            ranges = {}
            if service == "sandbox":
                lo = 1 + x % 3
                ranges["cpu"] = (lo, lo + x % 4)
            elif service.startswith("model:"):
                spec = cluster.model(service[6:])
                ranges["gpu"] = (spec.gpus, spec.gpus)
            a = Action(f"a{n}", service, Demand(ranges), trajectory=f"t{x % 4}" if x % 5 else None,
                       hint_s=(x % 7) / 2, parallel_fraction=(x % 3) / 3)
            rejected = h.engine.submit(a)
            if rejected is None:
                accepted.append(a.id)
        elif op == "complete" and h.engine.running:
            ids = sorted(h.engine.running)
            h.complete(ids[x % len(ids)], outcome=Outcome.OK if x % 2 else Outcome.FAILED)
            if x % 3 == 0:
                h.finish_loads()
        elif op == "advance":
            h.advance((x % 50) / 10)
        elif op == "end":
            h.engine.end_trajectory(f"t{x % 4}")
        elif op == "cancel" and h.engine.pending:
            ids = sorted(h.engine.pending)
            h.engine.cancel(ids[x % len(ids)])
        h.engine.schedule()
        check_invariants(h.engine)
        check_fair_share_ledger(h.engine)
        check_home_queues(h.engine)
    for _ in range(500):  # drain: finish what runs, end every trajectory, let quotas refill
        if not h.engine.pending and not h.engine.running:
            break
        for aid in sorted(h.engine.running):
            h.complete(aid)
        h.finish_loads()
        for t in range(4):
            h.engine.end_trajectory(f"t{t}")
        h.advance(1.0)
        h.engine.schedule()
        check_invariants(h.engine)
    assert not h.engine.pending and not h.engine.running, "actions left behind (deadlock)"
    ends = Counter(f.action.id for f in h.finished if f.outcome is not Outcome.REJECTED)
    assert set(ends) == set(accepted)
    assert all(v == 1 for v in ends.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["tangram", "fifo"]),
       sizes=st.lists(st.sampled_from([10.0, 25.0, 40.0]), min_size=2, max_size=4),
       script=st.lists(st.tuples(st.sampled_from(["submit", "submit", "complete"]), st.integers(0, 1000)),
                       min_size=2, max_size=80))
def test_gpu_residency_never_double_books_a_gpu(gpus, policy, sizes, script):
    """Many models sharing few GPUs: residents come and go, a GPU is never given twice, memory holds."""
    models = tuple(ModelSpec(f"m{i}", w, 1) for i, w in enumerate(sizes))
    h = Harness(Cluster(gpu_nodes=(GpuNode("g", gpus, 80.0, gpus, 25.0),), models=models), make_policy(policy))
    accepted = []
    for n, (op, x) in enumerate(script):
        if op == "submit":
            a = Action(f"a{n}", f"model:m{x % len(models)}", Demand({"gpu": (1, 1)}), hint_s=(x % 5) / 4)
            if h.engine.submit(a) is None:
                accepted.append(a.id)
        elif h.engine.running or h.rec.loading:
            ids = sorted(h.engine.running)
            h.advance(0.1)
            if ids:
                h.complete(ids[x % len(ids)])
            if x % 2:
                h.finish_loads()
        h.engine.schedule()
        check_invariants(h.engine)
    while h.engine.running or h.engine.pending or h.rec.loading:
        h.finish_loads()
        for aid in sorted(h.engine.running):
            h.advance(0.1)
            h.complete(aid)
        h.engine.schedule()
        check_invariants(h.engine)
    assert Counter(f.action.id for f in h.finished) == Counter(accepted)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["tangram", "fifo"]),
       script=st.lists(st.tuples(st.sampled_from(["submit", "submit", "submit", "complete", "join", "leave"]),
                                 st.integers(0, 1000)), min_size=2, max_size=80))
def test_gpu_nodes_joining_and_leaving_never_double_book_and_every_action_ends_once(policy, script):
    """GPU nodes come and go while model actions run (the Ray runtime's membership): nothing is
    placed on a GPU whose node has left, the counts hold, and every accepted action ends once (an
    action whose node died ends ``infra_error``, as its manager reports it)."""
    models = (ModelSpec("a", 10.0, 1), ModelSpec("b", 30.0, 2, compute_share=0.5))
    h = Harness(Cluster(models=models), make_policy(policy))
    nodes: list[int] = []
    accepted = []
    seen_starts = 0
    for n, (op, x) in enumerate(script):
        if op == "join" or (op == "leave" and not nodes):
            nodes.append(h.engine.add_gpu_node(GpuNode(f"g{n}", 1 + x % 2, 40.0, 2, 25.0)))
        elif op == "leave":
            gone = nodes.pop(x % len(nodes))
            dropped = h.engine.remove_gpu_node(gone)
            h.rec.loading = [k for k in h.rec.loading if k not in dropped]
            for aid in sorted(h.engine.running):  # its manager reports what ran there: lost
                if h.engine.gpu.gpus[h.engine.running[aid].allocation.units[0]].node == gone:
                    h.complete(aid, outcome=Outcome.INFRA_ERROR)
        elif op == "submit":
            m = models[x % 2]
            a = Action(f"a{n}", f"model:{m.name}", Demand({"gpu": (m.gpus, m.gpus)}), hint_s=(x % 5) / 4)
            if h.engine.submit(a) is None:
                accepted.append(a.id)
        elif h.engine.running or h.rec.loading:
            ids = sorted(h.engine.running)
            h.advance(0.1)
            if ids:
                h.complete(ids[x % len(ids)])
            if x % 2:
                h.finish_loads()
        h.engine.schedule()
        for action, alloc in h.rec.started[seen_starts:]:
            assert all(h.engine.gpu.gpus[g].alive for g in alloc.units), "placed on a GPU that left"
        seen_starts = len(h.rec.started)
        assert all(h.engine.gpu.gpus[g].alive for ld in h.engine.loading.values() for g in ld.block)
        check_invariants(h.engine)
    # a node that can take every model (actions waiting for an island that left wait for one;
    # a runtime bounds that wait with max_queue_s)
    nodes.append(h.engine.add_gpu_node(GpuNode("last", 2, 40.0, 2, 25.0)))
    for _ in range(500):
        if not (h.engine.running or h.engine.pending or h.rec.loading):
            break
        h.finish_loads()
        for aid in sorted(h.engine.running):
            h.advance(0.1)
            h.complete(aid)
        h.advance(1.0)
        h.engine.schedule()
        check_invariants(h.engine)
    ends = Counter(f.action.id for f in h.finished if f.outcome is not Outcome.REJECTED)
    assert set(ends) == set(accepted) and all(v == 1 for v in ends.values())


chain_ops = st.lists(st.tuples(st.sampled_from(["submit", "submit", "submit", "complete", "lose",
                                                "cancel", "advance", "take"]), st.integers(0, 10_000)),
                     min_size=20, max_size=80)  # long enough for queues to form


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cores=st.lists(st.integers(1, 2), min_size=1, max_size=2), policy=st.sampled_from(["tangram", "tangram-eager"]),
       script=chain_ops)
def test_followers_never_share_a_core_and_every_action_ends_once(cores, policy, script):
    """With a manager that chains (``Follow``): a follower holds nothing until its run ends, then
    exactly that run's cores; followers cancelled or lost before their turn end once and leave
    the cores to their run; the fair-share ledger counts a follower from when it was queued."""
    from arl_tangram.core.seam import Pool
    from arl_tangram.engine import Engine

    cluster = Cluster(tuple(CpuNode(f"c{i}", n, 64.0) for i, n in enumerate(cores)))
    h = Harness(cluster, policy_named(policy), costs=Costs(session_mem_gb=1.0))
    chains = Chaining(h.rec, can=lambda action: action.job != "solo")  # "solo": runs it could not chain
    h.engine = Engine(cluster, h.engine.policy, {Pool.CPU: chains}, h.clock, costs=Costs(session_mem_gb=1.0))
    h.engine.listeners.append(h.finished.append)
    e = h.engine
    accepted: list[str] = []
    for n, (op, x) in enumerate(script):
        if op == "submit":
            lo = 1 + (x % 4 == 0)
            hi = lo + (x % 5 == 0)
            a = Action(f"a{n}", "sandbox", Demand({"cpu": (lo, hi)}), trajectory=f"t{x % 3}" if x % 7 == 0 else None,
                       hint_s=(x % 3) * 0.04, job="solo" if x % 6 == 1 else "default")
            if e.submit(a) is None:
                accepted.append(a.id)
        elif op == "complete" and e.running:
            ids = sorted(e.running)
            h.complete(ids[x % len(ids)], exec_s=0.5 if x % 11 == 0 else (x % 3) * 0.04,
                       outcome=Outcome.OK if x % 2 else Outcome.FAILED)
        elif op == "lose" and e.following:  # a follower's runner lost, or a manager-side cancel
            ids = sorted(e.following)
            fol = e.followers[e.following[ids[x % len(ids)]]]
            if fol.taken:
                h.complete(ids[x % len(ids)], outcome=Outcome.INFRA_ERROR)
        elif op == "cancel":
            ids = sorted(e.pending) + sorted(e.following)
            if ids:
                aid = ids[x % len(ids)]
                taken = aid in e.following and e.followers[e.following[aid]].taken
                e.cancel(aid)
                if taken:  # the manager reports it
                    h.complete(aid, outcome=Outcome.CANCELLED)
        elif op == "advance":
            h.advance((x % 10) / 100)
        elif op == "take":
            chains.take = bool(x % 2)
        e.schedule()
        check_invariants(e)
        assert all(run.action.job != "solo" for run in e.followable.values()), "a run its manager cannot chain"
        for after, fol in e.followers.items():
            assert e.following[fol.action.id] == after and after in e.running
            assert fol.allocation.units == e.running[after].allocation.units, "a follower gets exactly its run's cores"
            assert fol.action.id not in e.running and fol.action.id not in e.pending
        assert len(e.following) == len(e.followers)
        assert not set(e.followable) & set(e.followers), "a run with a follower takes no second"
        units = e.policy.job_units
        held = Counter()
        for run in e.running.values():
            held[run.action.job] += len(run.allocation.units)
        for fol in e.followers.values():
            held[fol.action.job] += len(fol.allocation.units)
        assert {j: u.get("cpu", 0) for j, u in units.items() if u.get("cpu", 0)} == dict(held)
    for _ in range(500):
        if not e.pending and not e.running and not e.following:
            break
        for aid in sorted(e.running):
            h.complete(aid)
        for t in range(3):
            e.end_trajectory(f"t{t}")
        h.advance(1.0)
        e.schedule()
        check_invariants(e)
    assert not e.pending and not e.running and not e.following, "actions left behind"
    assert e.cpu.total_free == sum(cores)
    ends = Counter(f.action.id for f in h.finished if f.outcome is not Outcome.REJECTED)
    assert set(ends) == set(accepted) and all(v == 1 for v in ends.values())
