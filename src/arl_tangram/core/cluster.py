"""The cluster model: what pools exist and how big they are.

CPU nodes carry cores and memory; GPU nodes carry GPUs grouped into islands (NVLink domains: a
multi-GPU model instance must sit inside one), GPU memory and a host-to-GPU copy bandwidth; API
quotas carry a rate (token bucket) and a concurrency limit. Model services are registered here so
that placement knows their weights and instance size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .action import by_fields

#: host-to-GPU copy bandwidth (GB/s) assumed where none is measured: PCIe 4.0 x16 in practice;
#: `tangram bench models --device cuda` measures ~55 GB/s from pinned memory on PCIe 5.0 (H100/H200)
DEFAULT_H2D_GBPS = 25.0


@dataclass(frozen=True, slots=True)
class CpuNode:
    name: str
    cores: int
    memory_gb: float = 256.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails


@dataclass(frozen=True, slots=True)
class GpuNode:
    """``island_size`` GPUs share one NVLink domain; ``gpus`` must be a multiple of it. Discovered
    topologies give the islands explicitly (``groups``: local GPU indices per NVLink domain)."""

    name: str
    gpus: int
    gpu_memory_gb: float = 80.0
    island_size: int = 8
    h2d_gbps: float = DEFAULT_H2D_GBPS
    groups: tuple[tuple[int, ...], ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails

    def islands(self) -> list[list[int]]:
        if self.groups:
            return [list(g) for g in self.groups]
        size = min(self.island_size, self.gpus)
        return [list(range(i, min(i + size, self.gpus))) for i in range(0, self.gpus, size)]


@dataclass(frozen=True, slots=True)
class ApiQuota:
    """An external API's limits: ``rate_per_s`` refills a bucket of ``burst`` tokens; at most
    ``concurrency`` calls in flight."""

    name: str
    rate_per_s: float
    concurrency: int
    burst: float = 0.0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails

    @property
    def bucket(self) -> float:
        return self.burst if self.burst > 0 else max(1.0, self.rate_per_s)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model service: its weights (kept in host RAM) and GPUs per instance (1/2/4/8).

    ``compute_share``: the fraction of each of its GPUs' compute one batch is given; batches of
    different services whose shares add up to at most 1 run on a GPU at the same time (1: a batch
    has its GPUs to itself). ``idle_s``: a copy unused this long gives its GPU memory back (scale
    to zero; None keeps copies until memory is needed)."""

    name: str
    weights_gb: float
    gpus: int = 1
    compute_share: float = 1.0
    idle_s: float | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails

    def __post_init__(self) -> None:
        if not 0.0 < self.compute_share <= 1.0:
            raise ValueError(f"compute_share: {self.compute_share} is not in (0, 1] (model {self.name!r})")
        if self.idle_s is not None and self.idle_s < 0:
            raise ValueError(f"idle_s: must be >= 0, got {self.idle_s} (model {self.name!r})")

    def per_gpu_gb(self) -> float:
        return self.weights_gb / self.gpus


@dataclass(frozen=True, slots=True)
class Cluster:
    cpu_nodes: tuple[CpuNode, ...] = ()
    gpu_nodes: tuple[GpuNode, ...] = ()
    quotas: tuple[ApiQuota, ...] = ()
    models: tuple[ModelSpec, ...] = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return by_fields(self)  # compiled, a frozen class's default pickling fails

    @property
    def total_cores(self) -> int:
        return sum(n.cores for n in self.cpu_nodes)

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.gpu_nodes)

    def model(self, name: str) -> ModelSpec | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

    def per_gpu_gb(self, model: str, weights_gb: float, gpus: int) -> float:
        """GPU memory one copy of ``model`` takes on each GPU of its block: the registered spec's,
        else an unregistered model's ``weights_gb`` spread over its ``gpus``."""
        spec = self.model(model)
        return spec.per_gpu_gb() if spec is not None else weights_gb / gpus

    def quota(self, name: str) -> ApiQuota | None:
        for q in self.quotas:
            if q.name == name:
                return q
        return None

    def describe(self) -> dict:
        return {
            "cpu_nodes": len(self.cpu_nodes),
            "cpus": self.total_cores,
            "gpu_nodes": len(self.gpu_nodes),
            "gpus": self.total_gpus,
            "quotas": {q.name: {"rate_per_s": q.rate_per_s, "concurrency": q.concurrency} for q in self.quotas},
            "models": len(self.models),
        }


def uniform_cluster(
    cpus: int = 0,
    cpu_nodes: int = 1,
    gpus: int = 0,
    gpus_per_node: int = 8,
    *,
    memory_gb_per_core: float = 4.0,
    gpu_memory_gb: float = 80.0,
    island_size: int | None = None,
    h2d_gbps: float = DEFAULT_H2D_GBPS,
    quotas: tuple[ApiQuota, ...] = (),
    models: tuple[ModelSpec, ...] = (),
) -> Cluster:
    """``cpus`` cores spread evenly over ``cpu_nodes`` nodes; ``gpus`` GPUs in nodes of
    ``gpus_per_node`` (the last node takes the remainder); one island per node unless given."""
    if cpus < 0 or gpus < 0:
        raise ValueError("cpus and gpus must be >= 0")
    nodes: list[CpuNode] = []
    if cpus:
        cpu_nodes = max(1, min(cpu_nodes, cpus))
        base, extra = divmod(cpus, cpu_nodes)
        for i in range(cpu_nodes):
            cores = base + (1 if i < extra else 0)
            nodes.append(CpuNode(f"cpu-{i}", cores, cores * memory_gb_per_core))
    gnodes: list[GpuNode] = []
    left = gpus
    i = 0
    while left > 0:
        g = min(gpus_per_node, left)
        gnodes.append(GpuNode(f"gpu-{i}", g, gpu_memory_gb, island_size or g, h2d_gbps))
        left -= g
        i += 1
    return Cluster(tuple(nodes), tuple(gnodes), tuple(quotas), tuple(models))


def scale_cluster(cluster: Cluster, scale: float) -> Cluster:
    """Multiply every pool by ``scale``: node counts where there are enough nodes to keep their
    shape, otherwise the size of each node; quotas' rate and concurrency likewise. Never below one
    unit of anything that existed."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if scale == 1:
        return cluster
    cpus = [replace(n) for n in cluster.cpu_nodes]
    target = max(1, round(sum(n.cores for n in cpus) * scale)) if cpus else 0
    cpu_nodes: list[CpuNode] = []
    if cpus:
        n_nodes = max(1, min(len(cpus), round(len(cpus) * scale)))
        proto = cpus[0]
        mem_per_core = proto.memory_gb / proto.cores
        base, extra = divmod(target, n_nodes)
        for i in range(n_nodes):
            cores = max(1, base + (1 if i < extra else 0))
            cpu_nodes.append(CpuNode(f"cpu-{i}", cores, cores * mem_per_core))
    gpu_nodes: list[GpuNode] = []
    if cluster.gpu_nodes:
        proto_g = cluster.gpu_nodes[0]
        g_target = max(1, round(cluster.total_gpus * scale))
        full, rest = divmod(g_target, proto_g.gpus)
        for i in range(full):
            gpu_nodes.append(replace(proto_g, name=f"gpu-{i}"))
        if rest:
            island = min(proto_g.island_size, rest)
            while rest % island:
                island -= 1
            gpu_nodes.append(replace(proto_g, name=f"gpu-{full}", gpus=rest, island_size=island))
    quotas = tuple(
        replace(q, rate_per_s=q.rate_per_s * scale, concurrency=max(1, math.floor(q.concurrency * scale + 0.5)),
                burst=q.burst * scale)
        for q in cluster.quotas
    )
    return Cluster(tuple(cpu_nodes), tuple(gpu_nodes), quotas, cluster.models)
