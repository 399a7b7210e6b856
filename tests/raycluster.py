"""A loopback Ray cluster for the tests: a head with no cores (work goes to the nodes, as on a
real cluster whose head runs only Tangram's engine) and the nodes a test asks for, each added with
``Cluster.add_node``'s keyword arguments. Every address stays on 127.0.0.1
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, set before Ray starts)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def loopback_cluster(*nodes: dict[str, Any]) -> Iterator[tuple[Any, list[Any]]]:
    """Yields ``(cluster, nodes)``; the driver and the cluster are shut down afterwards."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        added = [c.add_node(**n) for n in nodes]
        c.wait_for_nodes()
        yield c, added
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
