"""``mergepipe dashboard``: start the Streamlit app (app.py) on 127.0.0.1 as a child process.

The library never imports Streamlit: this module only builds the command line and environment and
waits for the server. The app reads the catalog path from MERGEPIPE_DB and the folders it may read
checkpoints from / write outputs into from MERGEPIPE_ALLOWED_ROOTS (os.pathsep-separated).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from mergepipe.errors import MergePipeError
from mergepipe.api import ROOTS_ENV, env_allowed_roots as allowed_roots

APP = Path(__file__).resolve().parents[2] / "app.py"


def dashboard_command(port: int = 8501, app: Path = APP) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(app), "--server.port", str(int(port)),
            "--server.address", "127.0.0.1", "--server.headless", "true"]


def dashboard_env(db_path, extra_roots=None, base_env=None) -> dict[str, str]:
    """The app's environment: the caller's, with MERGEPIPE_DB set and MERGEPIPE_ALLOWED_ROOTS always
    set -- the caller's own roots when it has them (never replaced), else its working directory and
    the catalog's folder -- plus ``extra_roots`` (``--allow-root``, the demo's folder)."""
    env = dict(os.environ if base_env is None else base_env)
    db = Path(db_path).expanduser().absolute()
    env["MERGEPIPE_DB"] = str(db)
    roots = allowed_roots(env) or [Path.cwd(), db.parent]
    for r in extra_roots or []:
        roots.append(Path(r).expanduser().resolve())
    env[ROOTS_ENV] = os.pathsep.join(dict.fromkeys(str(Path(r).resolve()) for r in roots))
    return env


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Refuse a port something already listens on (another dashboard would otherwise answer the URL
    we print, showing another catalog)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            raise MergePipeError(f"port {port} on {host} is already in use ({exc.strerror or exc}); "
                                 f"stop what runs there or choose another with --port") from None


def wait_until_serving(proc: subprocess.Popen, port: int, timeout: float = 120.0, host: str = "127.0.0.1") -> None:
    """Wait until the server answers its health check; a child that exits first is an error."""
    url = f"http://{host}:{int(port)}/_stcore/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise MergePipeError(f"the dashboard server exited with status {code} before serving on port {port} "
                                 f"(is the port taken, or streamlit missing?)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise MergePipeError(f"the dashboard server did not answer on port {port} within {timeout:.0f} s")


def run_dashboard(db_path, port: int = 8501, extra_roots=None, wait: bool = True, stdout=None,
                  startup_timeout: float = 120.0):
    """Start ``python -m streamlit run app.py`` on 127.0.0.1:port for the catalog at ``db_path``,
    print the URL and wait for it (Ctrl-C stops it). With ``wait=False`` return the Popen (the
    server's output goes to ``stdout``, a file, when given). The app may read and write under the
    caller's MERGEPIPE_ALLOWED_ROOTS (default: working directory and catalog folder) plus
    ``extra_roots``."""
    if not APP.exists():
        raise MergePipeError(f"{APP}: the dashboard app is missing (install MergePipe from a source checkout)")
    if not 0 < int(port) < 65536:
        raise MergePipeError(f"bad port {port}")
    db = Path(db_path).expanduser().absolute()
    if not db.parent.is_dir():
        raise MergePipeError(f"{db.parent}: directory does not exist")
    check_port_free(port)
    # Run from the app's folder: Streamlit reads .streamlit/config.toml (the security settings) from
    # its working directory, and puts that directory first on the import path.
    proc = subprocess.Popen(dashboard_command(port), env=dashboard_env(db, extra_roots), stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None, cwd=APP.parent)
    if not wait:
        return proc
    try:
        wait_until_serving(proc, port, startup_timeout)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    print(f"MergePipe dashboard for {db}: http://127.0.0.1:{int(port)}/  (Ctrl-C to stop)", flush=True)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)  # stopping us stops the server too
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
