"""Host discovery: this machine as a ``Cluster`` (its cores, memory, GPUs and API quotas).

Kept apart from the runtime's wiring so that the same runtime can be built over a cluster that is
detected, configured or (with Ray) assembled from many nodes.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from ..core.cluster import DEFAULT_H2D_GBPS, ApiQuota, Cluster, CpuNode, GpuNode, ModelSpec

#: the share of a GPU's memory the engine may plan with (the rest: CUDA context, fragmentation)
GPU_MEMORY_USABLE = 0.9
#: memory of a CPU "device" when model services run without CUDA and no size is given
CPU_DEVICE_MEMORY_GB = 16.0


log = logging.getLogger(__name__)


def helper_processes(cores: int) -> int:
    """How many HTTP fronts, and how many sandbox workers, a server on ``cores`` CPUs starts by
    default: none on a small machine (another process competes for the same cores and the link
    adds a hop: 1 front + 1 worker measured 0.88x of none on 2 cores), else one per 4 cores, at
    most 8 (8 + 8 measured no better than 4 + 4 on 16 cores)."""
    return 0 if cores <= 2 else min(8, max(1, cores // 4))


def die_with_parent(what: str) -> None:
    """Ask the kernel to end this helper process when its parent (the engine process) dies
    (``PR_SET_PDEATHSIG``), so a killed server leaves no front or worker behind."""
    import ctypes
    import signal
    import sys

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        log.warning("%s: cannot ask to die with the engine process (errno %d)", what, ctypes.get_errno())
    if os.getppid() == 1:  # the engine process died before we asked
        sys.exit(1)


def memory_gb() -> float:
    """This machine's physical memory (``MemTotal``), 8 GB when it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 8.0


def mem_available_mb() -> float | None:
    """Memory the kernel says can be had without swapping (``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def host_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return tuple(sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class LocalHost:
    """What this machine offers: ``cores`` for sandboxes (0: none), ``gpus`` devices of
    ``gpu_memory_gb`` each for model services (CUDA GPUs, or CPU "devices"), API quotas."""

    cores: int
    memory_gb: float
    gpus: int = 0
    gpu_memory_gb: float = 0.0
    gpu_islands: tuple[tuple[int, ...], ...] = ()  # NVLink domains (local GPU indices); () = one island

    @classmethod
    def detect(cls, *, sandboxes: bool = True, cores: int | None = None, memory: float | None = None,
               models: bool = False, cuda: bool = False, gpus: int | None = None,
               gpu_memory_gb: float | None = None, gpu_island_size: int | None = None) -> "LocalHost":
        """Measure this machine; every figure given overrides what would be detected. GPUs, their
        memory and NVLink islands come from NVML or nvidia-smi (``managers.models.topology``)."""
        n_cores = (cores or len(host_cpus())) if sandboxes else 0
        n_gpus, mem, islands = 0, 0.0, ()
        if models:
            from ..managers.models.topology import discover_gpus, gpu_node

            found = discover_gpus() if cuda else []
            if cuda and not found:  # CUDA without NVML or nvidia-smi: count through torch, one island
                import torch

                n_gpus = gpus or torch.cuda.device_count()
                device_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
            else:
                n_gpus = gpus or len(found) or 1
                device_gb = min((g.memory_gb for g in found[:n_gpus]), default=CPU_DEVICE_MEMORY_GB / GPU_MEMORY_USABLE)
            mem = gpu_memory_gb or device_gb * GPU_MEMORY_USABLE
            node = gpu_node(found, count=n_gpus, memory_gb=mem, island_size=gpu_island_size)
            islands = tuple(tuple(i) for i in node.islands()) if node is not None else ()
        return cls(n_cores, memory or memory_gb(), n_gpus, mem, islands)

    def cluster(self, quotas: tuple[ApiQuota, ...] = (), models: tuple[ModelSpec, ...] = ()) -> Cluster:
        """One CPU node and one GPU node named after this host (its discovered islands)."""
        cpu = (CpuNode("local", self.cores, self.memory_gb),) if self.cores else ()
        gpu = (GpuNode("local-gpu", self.gpus, self.gpu_memory_gb, max(map(len, self.gpu_islands), default=self.gpus),
                       DEFAULT_H2D_GBPS, groups=self.gpu_islands),) if self.gpus else ()
        return Cluster(cpu, gpu, quotas, models)
