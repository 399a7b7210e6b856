"""A live server for tests: ``tangram serve`` (or its double-backed twin) in a subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from arl_tangram.bench.server import free_port, wait_up


class Server:
    """``tangram serve`` as a subprocess on a free loopback port; ``double=True`` serves over the
    in-process sandbox double (``serve_double.py``) instead of real sandboxes; ``args``: more
    ``tangram serve`` flags (``--ray ADDRESS``, ``--fronts N``; the double takes ``--fronts``)."""

    def __init__(self, tmp_path, config: dict | None = None, token: str | None = None, journal=None,
                 double: bool = False, args: tuple[str, ...] = (), start_timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.journal = str(journal or tmp_path / "journal.sqlite3")
        path = None
        if config is not None:
            path = tmp_path / f"config-{self.port}.json"
            path.write_text(json.dumps(config))
        if double:
            if token:
                raise ValueError("the double server takes no token")
            argv = [sys.executable, str(Path(__file__).parent / "serve_double.py"), str(self.port), self.journal]
            argv += [str(path)] if path else []
            argv += list(args)  # --fronts N
        else:
            argv = [sys.executable, "-m", "arl_tangram.cli", "serve", "--port", str(self.port), "--journal",
                    self.journal]
            argv += ["--config", str(path)] if path else []
            argv += ["--token", token] if token else []
            argv += list(args)
        log = tmp_path / f"server-{self.port}.log"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_up(self.url, timeout_s=start_timeout_s, proc=self.proc, log=str(log))
        except RuntimeError:
            self.stop()
            raise

    def children(self) -> list[int]:
        """Pids of the server's direct child processes (its HTTP fronts, sandbox helpers)."""
        return children_of(self.proc.pid)

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child its parent has not reaped yet counts as
    gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
