"""`tangram serve` over the in-process sandbox double, for service tests on hosts without
bubblewrap: ``python tests/serve_double.py PORT JOURNAL [CONFIG.json] [--fronts N]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import uvicorn

sys.path.insert(0, str(Path(__file__).parent))

from doubles import InProcessSandboxes  # noqa: E402

from arl_tangram.server import fronts  # noqa: E402
from arl_tangram.server.config import ServeConfig, build, build_service  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    n_fronts = 0
    if "--fronts" in args:
        i = args.index("--fronts")
        n_fronts = int(args[i + 1])
        del args[i:i + 2]
    port, journal = int(args[0]), Path(args[1])
    cfg = ServeConfig.model_validate(json.loads(Path(args[2]).read_text())) if len(args) > 2 else ServeConfig()
    double = InProcessSandboxes.factory(config=cfg.sandbox)
    if n_fronts:
        service = build_service(cfg, journal=journal, sandboxes=double)
        fronts.serve(service, fronts.listen("127.0.0.1", port), n_fronts, None, int(cfg.max_body_mb * (1 << 20)),
                     cfg.drain_s, settings=cfg.dialect_settings())
    else:
        app = build(cfg, journal=journal, sandboxes=double)
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
