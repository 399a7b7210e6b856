"""The server's app builds with only the bare install's packages: ``tangram serve`` from ``pip install .``
must not need what a test extra happens to bring (python-multipart came with the daytona SDK, and
a route that FastAPI read as form data failed only on a bare install)."""

import subprocess
import sys
import textwrap

# packages the bare install does not have, hidden as if missing
NOT_INSTALLED = ("multipart", "python_multipart", "daytona", "e2b", "openai", "torch", "ray")


def test_the_app_builds_without_packages_the_bare_install_lacks():
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {NOT_INSTALLED!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}}")
        sys.meta_path.insert(0, Missing())
        from arl_tangram.server.app import create_app
        from arl_tangram.server.calls import DIALECTS
        app = create_app(object(), dialects=DIALECTS)
        print(len(app.routes))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip()) > 50
