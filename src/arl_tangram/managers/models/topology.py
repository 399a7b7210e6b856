"""This host's GPUs as the engine sees them: count, memory, and NVLink islands, discovered.

``discover_gpus()`` asks NVML (the ``nvidia-ml-py`` package) first, then ``nvidia-smi``, and finds
nothing on a host with neither (CPU-only hosts are unchanged: no GPU pool). Two GPUs are in one
island when NVLink joins them (directly or through others: NVSwitch systems form one island); a
GPU without NVLink peers is an island of its own, so a multi-GPU instance never straddles PCIe.
Indices are CUDA ordinals of this process (``CUDA_VISIBLE_DEVICES`` is honoured), so the manager's
``cuda:{index}`` is the GPU the engine placed on.

``gpu_node()`` turns the discovery into the engine's ``GpuNode``; every field can be overridden
from config (count, memory per GPU, island size, host-to-GPU bandwidth).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from dataclasses import dataclass

from ...core.cluster import GpuNode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int  # CUDA ordinal in this process
    memory_gb: float
    island: int  # NVLink domain, numbered from 0 in order of first GPU
    name: str = ""
    uuid: str = ""


def discover_gpus(source: str = "auto") -> list[GpuInfo]:
    """``[GpuInfo(index, memory_gb, island, ...)]`` of this host's visible GPUs; ``source`` is
    ``auto`` (NVML, then nvidia-smi), ``nvml`` or ``smi``. Never raises for a host without GPUs."""
    if source in ("auto", "nvml"):
        found = _from_nvml()
        if found is not None or source == "nvml":
            return _visible(found or [])
    if source in ("auto", "smi"):
        found = _from_smi()
        if found is not None:
            return _visible(found)
    if source not in ("auto", "nvml", "smi"):
        raise ValueError(f"source: unknown GPU discovery source {source!r} (auto, nvml, smi)")
    return []


def islands_of(n: int, linked: set[tuple[int, int]]) -> list[int]:
    """Island number of each of ``n`` GPUs given NVLink-joined pairs (connected components,
    numbered in order of their lowest GPU)."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in linked:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    ids: dict[int, int] = {}
    return [ids.setdefault(find(g), len(ids)) for g in range(n)]


def parse_topo_matrix(text: str) -> set[tuple[int, int]]:
    """NVLink-joined GPU pairs from ``nvidia-smi topo -m``: a cell ``NV<k>`` joins its row's and
    column's GPUs (``X`` is the GPU itself; PIX/PXB/PHB/NODE/SYS are PCIe or CPU paths)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return set()
    header = lines[0].split()
    cols = [h for h in header if h.startswith("GPU") and h[3:].isdigit()]
    linked = set()
    for ln in lines[1:]:
        cells = ln.split()
        if not cells or not (cells[0].startswith("GPU") and cells[0][3:].isdigit()):
            continue
        row = int(cells[0][3:])
        for col, cell in zip(cols, cells[1:1 + len(cols)]):
            other = int(col[3:])
            if cell.startswith("NV") and other != row:
                linked.add((min(row, other), max(row, other)))
    return linked


def gpu_node(gpus: list[GpuInfo], *, count: int | None = None, memory_gb: float | None = None,
             island_size: int | None = None, h2d_gbps: float = 25.0, name: str = "local-gpu") -> GpuNode | None:
    """The engine's view of this host's GPUs; config overrides win (``island_size`` replaces the
    discovered islands with equal blocks). None when there are no GPUs and no ``count``."""
    n = count if count is not None else len(gpus)
    if n <= 0:
        return None
    mem = memory_gb if memory_gb is not None else min((g.memory_gb for g in gpus[:n]), default=16.0)
    if island_size is not None:
        if island_size < 1 or n % island_size:
            raise ValueError(f"gpu_island_size: {island_size} does not divide the {n} GPUs")
        return GpuNode(name, n, mem, island_size, h2d_gbps)
    if len(gpus) >= n:
        by_island: dict[int, list[int]] = {}
        for local, g in enumerate(gpus[:n]):
            by_island.setdefault(g.island, []).append(local)
        groups = tuple(tuple(v) for v in by_island.values())
        return GpuNode(name, n, mem, max(len(g) for g in groups), h2d_gbps, groups=groups)
    return GpuNode(name, n, mem, n, h2d_gbps)  # counted, not discovered (CPU devices): one island


# -- sources -------------------------------------------------------------------------------------
def _from_nvml() -> list[GpuInfo] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.debug("NVML unavailable: %s", e)
        return None
    try:
        n = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        linked = set()
        for a in range(n):
            for b in range(a + 1, n):
                try:
                    status = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                except Exception:  # NVMLError, or a driver/binding without this query: no NVLink known
                    continue
                if status == pynvml.NVML_P2P_STATUS_OK:
                    linked.add((a, b))
        island = islands_of(n, linked)
        out = []
        for i, h in enumerate(handles):
            name = pynvml.nvmlDeviceGetName(h)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            out.append(GpuInfo(i, pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9, island[i],
                               name.decode() if isinstance(name, bytes) else name,
                               uuid.decode() if isinstance(uuid, bytes) else uuid))
        return out
    except pynvml.NVMLError as e:
        log.warning("NVML discovery failed: %s", e)
        return None
    finally:
        pynvml.nvmlShutdown()


def _from_smi() -> list[GpuInfo] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        q = subprocess.run([exe, "--query-gpu=index,memory.total,name,uuid", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20, check=True).stdout
        topo = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi discovery failed: %s", e)
        return None
    rows = [[c.strip() for c in ln.split(",")] for ln in q.splitlines() if ln.strip()]
    island = islands_of(len(rows), parse_topo_matrix(topo))
    return [GpuInfo(int(r[0]), float(r[1]) * (1 << 20) / 1e9, island[i], r[2], r[3]) for i, r in enumerate(rows)]


def _visible(gpus: list[GpuInfo]) -> list[GpuInfo]:
    """Keep and renumber the GPUs ``CUDA_VISIBLE_DEVICES`` shows this process, in its order."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return gpus
    picked = []
    for tok in (t.strip() for t in env.split(",")):
        if not tok:
            break
        match = [g for g in gpus if (tok.isdigit() and g.index == int(tok)) or (g.uuid and g.uuid.startswith(tok))]
        if not match:
            break  # CUDA stops at the first invalid entry too
        picked.append(match[0])
    # islands renumbered over what is visible
    ids: dict[int, int] = {}
    return [GpuInfo(i, g.memory_gb, ids.setdefault(g.island, len(ids)), g.name, g.uuid) for i, g in enumerate(picked)]
