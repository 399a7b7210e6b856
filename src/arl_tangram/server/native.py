"""The native HTTP dialect (``/v1/...``, ``/metrics``, ``/healthz``): routes straight onto ``Service``.

Its calls are ``Service``'s own methods; the schemas are ``api/v1.py`` (OpenAPI at ``/docs``).
"""

from __future__ import annotations

from typing import Any, Sequence

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import PlainTextResponse

from ..api import v1
from .dialect import Dialect, answer
from .service import Forbidden, Service


def routes(router: APIRouter, calls: Any, guarded: Sequence[Any]) -> None:
    @router.post("/v1/actions", response_model=v1.ActionResult, tags=["actions"], dependencies=guarded,
              responses={202: {"model": v1.ActionResult}, 429: {"model": v1.Error}})
    async def submit(req: v1.ActionRequest, response: Response) -> v1.ActionResult:
        result = await calls.submit(req)
        if result.state != "done":
            response.status_code = 202
        return result

    @router.get("/v1/actions/{action_id}", response_model=v1.ActionResult, tags=["actions"], dependencies=guarded,
             responses={404: {"model": v1.Error}})
    async def get_action(action_id: str) -> v1.ActionResult:
        return await answer(calls.status(action_id))

    @router.post("/v1/actions/{action_id}/cancel", response_model=v1.ActionResult, tags=["actions"],
              dependencies=guarded, responses={404: {"model": v1.Error}})
    async def cancel(action_id: str) -> v1.ActionResult:
        return await calls.cancel(action_id)

    @router.post("/v1/sessions", response_model=v1.SessionInfo, status_code=201, tags=["sessions"],
              responses={503: {"model": v1.Error, "description": "no memory for a new session (the limit is named)"}},
              dependencies=guarded)
    async def open_session(req: v1.SessionRequest) -> v1.SessionInfo:
        return await calls.open_session(req)

    @router.get("/v1/sessions/{session_id}", response_model=v1.SessionState, tags=["sessions"],
             dependencies=guarded, responses={404: {"model": v1.Error}})
    async def session_state(session_id: str) -> v1.SessionState:
        return await answer(calls.session_state(session_id))

    @router.post("/v1/sessions/{session_id}/exec", response_model=v1.ActionResult, tags=["sessions"],
              dependencies=guarded, responses={404: {"model": v1.Error}})
    async def exec_(session_id: str, req: v1.ExecRequest) -> v1.ActionResult:
        return await calls.exec(session_id, req)

    @router.put("/v1/sessions/{session_id}/files", response_model=v1.ActionResult, tags=["sessions"],
             dependencies=guarded, responses={404: {"model": v1.Error}})
    async def put_files(session_id: str, req: v1.PutFiles) -> v1.ActionResult:
        return await calls.put_files(session_id, req)

    @router.get("/v1/sessions/{session_id}/files", response_model=v1.GotFiles, tags=["sessions"],
             dependencies=guarded, responses={404: {"model": v1.Error}})
    async def get_files(session_id: str, path: list[str] = Query(default=[])) -> v1.GotFiles:
        return await calls.get_files(session_id, path)

    @router.post("/v1/sessions/{session_id}/fs", response_model=v1.FsResult, tags=["sessions"], dependencies=guarded,
                 responses={403: {"model": v1.Error}, 404: {"model": v1.Error}, 409: {"model": v1.Error},
                            422: {"model": v1.Error}})
    async def fs(session_id: str, req: v1.FsRequest) -> v1.FsResult:
        return await calls.fs(session_id, req)

    @router.post("/v1/sessions/{session_id}/fork", response_model=v1.ForkResult, tags=["sessions"],
              dependencies=guarded, responses={404: {"model": v1.Error}})
    async def fork(session_id: str, req: v1.ForkRequest) -> v1.ForkResult:
        return await calls.fork(session_id, req)

    @router.post("/v1/sessions/{session_id}/snapshot", response_model=v1.SnapshotInfo, status_code=201,
                 tags=["sessions"], dependencies=guarded,
                 responses={404: {"model": v1.Error}, 422: {"model": v1.Error}, 503: {"model": v1.Error}})
    async def snapshot(session_id: str) -> v1.SnapshotInfo:
        return await calls.snapshot(session_id)

    @router.get("/v1/snapshots", response_model=list[v1.SnapshotInfo], tags=["sessions"], dependencies=guarded)
    async def snapshots() -> list[v1.SnapshotInfo]:
        return await answer(calls.list_snapshots())

    @router.delete("/v1/snapshots/{snapshot_id}", status_code=204, tags=["sessions"], dependencies=guarded,
                   responses={404: {"model": v1.Error}})
    async def delete_snapshot(snapshot_id: str) -> Response:
        await answer(calls.delete_snapshot(snapshot_id))
        return Response(status_code=204)

    @router.get("/v1/images", response_model=list[v1.ImageInfo], tags=["sessions"], dependencies=guarded)
    async def images() -> list[v1.ImageInfo]:
        return await answer(calls.images())

    @router.post("/v1/pools/prewarm", response_model=v1.PrewarmResult, tags=["sessions"], dependencies=guarded,
              responses={422: {"model": v1.Error}})
    async def prewarm(req: v1.PrewarmRequest) -> v1.PrewarmResult:
        return await calls.prewarm(req)

    @router.delete("/v1/sessions/{session_id}", status_code=204, tags=["sessions"], dependencies=guarded,
                responses={404: {"model": v1.Error}})
    async def close_session(session_id: str) -> Response:
        await calls.close_session(session_id)
        return Response(status_code=204)

    @router.post("/v1/models/{model}/score", response_model=v1.ModelResult, tags=["models"], dependencies=guarded,
              responses={404: {"model": v1.Error}})
    async def score(model: str, req: v1.ModelRequest) -> v1.ModelResult:
        return await calls.model_call(model, "score", req)

    @router.post("/v1/models/{model}/logprobs", response_model=v1.ModelResult, tags=["models"], dependencies=guarded,
              responses={404: {"model": v1.Error}})
    async def logprobs(model: str, req: v1.ModelRequest) -> v1.ModelResult:
        return await calls.model_call(model, "logprobs", req)

    @router.get("/v1/jobs", response_model=list[v1.JobStats], tags=["stats"], dependencies=guarded)
    async def jobs() -> list[v1.JobStats]:
        return await answer(calls.all_jobs())

    @router.get("/v1/jobs/{job}/stats", response_model=v1.JobStats, tags=["stats"], dependencies=guarded,
             responses={404: {"model": v1.Error}})
    async def job_stats(job: str) -> v1.JobStats:
        return await answer(calls.job_stats(job))

    @router.get("/v1/cluster", response_model=v1.ClusterInfo, tags=["stats"], dependencies=guarded,
                responses={403: {"model": v1.Error}})
    async def cluster(request: Request) -> v1.ClusterInfo:
        _every_job(request, "GET /v1/cluster")
        return await answer(calls.cluster())

    @router.post("/v1/cluster/nodes/{node_id}/drain", response_model=v1.ClusterNode, tags=["stats"],
                 dependencies=guarded, responses={404: {"model": v1.Error}, 422: {"model": v1.Error}})
    async def drain_node(node_id: str, request: Request) -> v1.ClusterNode:
        _every_job(request, "POST /v1/cluster/nodes/{id}/drain")
        return await answer(calls.drain_node(node_id))

    @router.get("/metrics", tags=["stats"], dependencies=guarded, responses={403: {"model": v1.Error}})
    async def metrics(request: Request) -> PlainTextResponse:
        _every_job(request, "GET /metrics")
        text = await answer(calls.metrics_text()) + await answer(calls.image_metrics())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @router.get("/healthz", tags=["stats"])
    async def healthz(request: Request) -> dict:
        """Liveness for anyone; the server's figures (every job's) only with the token, or where
        the server has no token and no keys."""
        admin = request.app.state.is_admin(request)
        health = await answer(calls.health(admin))  # a probe's liveness asks no sandbox worker anything
        if admin:
            return health
        return {"status": health["status"], "version": health["version"]}


def _every_job(request: Request, what: str) -> None:
    """The views of the whole server (every job's actions, nodes, metrics) are the token's: an API
    key acts as one job and sees only it (``/v1/jobs``)."""
    if not request.app.state.is_admin(request):
        raise Forbidden(f"{what}: shows every job's figures, so it needs the server's token (--token); an API "
                        "key sees its own job in /v1/jobs")


#: the image pulls' lines of /metrics: (name, type, help, key of ``Runtime.image_stats``)
IMAGE_METRICS = (
    ("tangram_image_pulls_total", "counter", "Images pulled from registries", "pulls"),
    ("tangram_image_pull_failures_total", "counter", "Image pulls that failed", "pull_failures"),
    ("tangram_image_pulled_bytes_total", "counter", "Layer bytes downloaded from registries", "bytes_pulled"),
    ("tangram_image_pull_seconds_total", "counter", "Seconds spent pulling images", "pull_seconds"),
    ("tangram_image_cache_hits_total", "counter", "New sandboxes whose image was on the node already", "cache_hits"),
    ("tangram_image_evictions_total", "counter", "Images removed to keep the store within images.max_gb", "evicted"),
    ("tangram_image_disk_bytes", "gauge", "Disk the image store's layers use", "disk_bytes"),
    ("tangram_image_disk_limit_bytes", "gauge", "images.max_gb, in bytes", "disk_limit_bytes"),
    ("tangram_image_pulls_in_flight", "gauge", "Image pulls under way", "pulling"),
)


def image_metrics(service: Service) -> str:
    """``/metrics``' lines of image pulls and the image store (none without a sandbox manager here)."""
    stats = service.runtime.image_stats()
    if stats is None:
        return ""
    lines = []
    for name, kind, help_, key in IMAGE_METRICS:
        value = stats.get(key)
        if value is None:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value)!r}"]
    return "\n".join(lines) + "\n" if lines else ""


DIALECT = Dialect("native", {
    "submit": Service.submit, "run_oneshot": Service.run_oneshot, "status": Service.status, "cancel": Service.cancel,
    "open_session": Service.open_session, "session_state": Service.session_state, "exec": Service.exec, "put_files": Service.put_files,
    "get_files": Service.get_files, "fs": Service.fs, "fork": Service.fork, "prewarm": Service.prewarm,
    "snapshot": Service.snapshot, "list_snapshots": Service.list_snapshots, "delete_snapshot": Service.delete_snapshot,
    "images": Service.images,
    "close_session": Service.close_session, "model_call": Service.model_call, "all_jobs": Service.all_jobs,
    "job_stats": Service.job_stats, "cluster": Service.cluster, "drain_node": Service.drain_node, "health": Service.health,
    "metrics_text": Service.metrics_text, "image_metrics": image_metrics,
}, routes)
