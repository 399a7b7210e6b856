"""`tangram serve` over the in-process sandbox double, for service tests on hosts without
bubblewrap: ``python tests/serve_double.py PORT JOURNAL [CONFIG.json]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from doubles import InProcessSandboxes  # noqa: E402

from arl_tangram.server.config import ServeConfig, build  # noqa: E402

if __name__ == "__main__":
    port, journal = int(sys.argv[1]), Path(sys.argv[2])
    cfg = ServeConfig.model_validate(json.loads(Path(sys.argv[3]).read_text())) if len(sys.argv) > 3 else ServeConfig()
    app = build(cfg, journal=journal, sandboxes=InProcessSandboxes.factory(config=cfg.sandbox))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
