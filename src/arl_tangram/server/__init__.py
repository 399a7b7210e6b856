"""The HTTP service: ``tangram serve`` (FastAPI + uvicorn) over the embedded local runtime."""
