"""Prefect's temporary API server for a ``citer`` command, started early and cheaply, and shared by a ``dvc repro``.

With no ``PREFECT_API_URL`` a flow run starts a temporary server (``prefect.server.api.server.SubprocessASGIServer``:
uvicorn in a subprocess on a free port) and waits for it: 3.5-4 s and as much CPU on this project's 2-core machines,
every command. Starting it through Prefect also costs the command itself ~1.8 s of CPU first (importing
``prefect.server.api.server``, beyond ``import prefect``). So:

- :func:`boot`: a stage command starts the same uvicorn command itself, on a socket it bound (no port race), sets
  ``PREFECT_API_URL`` to it and lets its own imports run while the server boots; :func:`ready` waits for the server's
  health check. The server is the command's child and goes with it (stopped at exit, by Ctrl-C, or by the reaper
  after a SIGKILL), as Prefect's own would.
- :func:`join_repro_server`: under ``dvc repro`` (``DVC_STAGE`` set, a ``dvc`` ancestor) the first stage command
  leaves one server for the whole repro, registered under ``$PREFECT_HOME/citer-server/``; the later stages find it
  and start none. It is no child of any stage (a small keeper process in its own session holds it) and stops within
  a second or two of that ``dvc`` process ending, however it ends.

Only the ``citer`` console command does either (a process that embeds the CLI leaves the server to Prefect), and
nothing starts when an API URL is set (a real server, a test harness) or Prefect's temporary servers are off.
``CITER_SHARED_SERVER=0`` gives each stage of a repro its own server again.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# What Prefect's SubprocessASGIServer sets for its server: no UI, the ephemeral set of services.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
REGISTRY = "citer-server"  # under PREFECT_HOME
# "url"; "proc" (this command's own server) or "keeper" ((pid, start) of a repro's); "booting" until it answered;
# "joined" when a repro's server was running already
_STATE: dict[str, Any] = {}

# Run by a throwaway process: fork the keeper (which then belongs to no stage command: a reaper watching the command
# never sees it as a descendant), tell the parent its pid, exit.
_LAUNCH = """import os, sys
pid = os.fork()
if pid == 0:
    os.setsid()
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.execv(sys.argv[1], sys.argv[1:])
print(pid, flush=True)
"""


def _site_packages() -> str:
    """Where ``prefect`` is installed (uvicorn's ``--app-dir``, as Prefect passes it), without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    if spec is None or spec.origin is None:
        raise ImportError("prefect is not installed")
    return str(Path(spec.origin).parent.parent)


def server_command(fd: int) -> list[str]:
    """Prefect's own temporary-server command (``SubprocessASGIServer._run_uvicorn_command``), on socket ``fd``."""
    return [
        sys.executable, "-m", "uvicorn", "--app-dir", _site_packages(), "--factory",
        "prefect.server.api.server:create_app", "--fd", str(fd), "--log-level", "error", "--lifespan", "on",
    ]  # fmt: skip


def server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    return env | SERVER_ENV


def _listen() -> tuple[socket.socket, str]:
    """A listening socket on a free loopback port, and the API URL it will serve. Until the server accepts,
    requests wait in the socket's backlog instead of being refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}/api"


def _needed() -> bool:
    """No API URL is configured and Prefect may start a temporary server (Prefect's own settings decide: env,
    profile, prefect.toml)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and bool(PREFECT_SERVER_EPHEMERAL_ENABLED.value())


def _use(url: str) -> None:
    """Point this process (and its children) at ``url``."""
    os.environ["PREFECT_API_URL"] = url
    if "prefect.context" in sys.modules:  # imported already: its settings were read from the environment then
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()
    _STATE["url"] = url


def boot() -> Callable[[Iterable[str]], None]:
    """Start this command's temporary server unless one is configured or shared (:func:`join_repro_server`);
    returns :func:`ready`, to call with the modules to import while the server boots."""
    if "url" not in _STATE and _needed():
        sock, url = _listen()
        try:
            proc = subprocess.Popen(
                server_command(sock.fileno()), env=server_env(), pass_fds=(sock.fileno(),)
            )
        finally:
            sock.close()
        _STATE.update(proc=proc, booting=True)
        _use(url)
        import atexit

        atexit.register(stop)
    return ready


def flow_settings() -> contextlib.AbstractContextManager[Any]:
    """The settings a command's flows run under: on a temporary server of ours, no flow-run heartbeats. They feed
    Prefect's zombie-run automations, which a temporary server has none of, and each flow run's end waits up to 1 s
    for the heartbeat thread's next tick (measured 0.9 s of a 6.5 s `citer data validate`)."""
    if "url" not in _STATE:
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def ready(preload: Iterable[str] = ()) -> None:
    """Wait until the server this command uses answers; if the command started it just now, import ``preload``
    first (while it boots, on the other core)."""
    if not _STATE.get("booting"):
        return
    if not _STATE.get("joined"):  # started just now: it takes seconds (a repro's running one answers at once)
        import importlib

        for name in preload:
            importlib.import_module(name)
    _wait_healthy()
    _STATE["booting"] = False


def _alive() -> bool:
    proc = _STATE.get("proc")
    if proc is not None:
        return proc.poll() is None
    keeper = _STATE.get("keeper")
    if keeper is not None:
        from citer.ops.reaper import alive

        return alive(*keeper)
    return True


def _wait_healthy() -> None:
    url = _STATE["url"]
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    timeout = float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    deadline = time.monotonic() + timeout
    while True:
        if _healthy(url, min(2.0, max(deadline - time.monotonic(), 0.1))):
            return
        if not _alive():
            proc = _STATE.get("proc")
            code = f" (exit code {proc.returncode})" if proc is not None else ""
            raise RuntimeError(f"Prefect's temporary server at {url} exited before it answered{code}")
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"Timed out after {timeout:g} s waiting for Prefect's temporary server at {url}"
            )
        time.sleep(0.05)


def _healthy(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def stop() -> None:
    """Stop this command's own server (not a repro's shared one), as Prefect stops its own at exit."""
    proc = _STATE.pop("proc", None)
    if proc is not None:
        _terminate(proc)


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a server still running, SIGKILL it if it has not gone 5 s later."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def join_repro_server() -> None:
    """Under ``dvc repro``: use the repro's server, starting it if this is the first stage to need one.

    Call it before the command starts its reaper (so the keeper is never seen as the command's descendant). Any
    failure leaves the command to start its own server, as outside ``dvc``.
    """
    if not os.environ.get("DVC_STAGE") or os.environ.get("CITER_SHARED_SERVER", "1").strip() == "0":
        return
    try:
        from citer.ops.reaper import ancestor_named, start_time

        dvc = ancestor_named("dvc")
        if dvc is None or not _needed():
            return
        _join(dvc.pid, start_time(dvc.pid))
    except Exception:  # noqa: BLE001 - sharing is an optimisation: the command boots its own server instead
        if os.environ.get("CITER_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}:
            import traceback

            traceback.print_exc()


def _registry_dir() -> Path:
    from prefect.settings import PREFECT_HOME

    path = Path(PREFECT_HOME.value()) / REGISTRY
    path.mkdir(parents=True, exist_ok=True)
    return path


def _join(owner_pid: int, owner_start: str) -> None:
    import fcntl

    from citer.ops.reaper import alive, start_time

    if not owner_start:
        return
    reg_dir = _registry_dir()
    key = f"dvc-{owner_pid}-{owner_start.replace('.', '_')}"
    reg = reg_dir / f"{key}.json"
    with open(reg_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # stages of one repro run one at a time, but `dvc repro` may not
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(reg.read_text())
            if alive(info["keeper_pid"], info["keeper_start"]):
                _STATE.update(keeper=(info["keeper_pid"], info["keeper_start"]), booting=True, joined=True)
                _use(info["url"])
                return
        _prune(reg_dir, keep=reg)
        sock, url = _listen()
        try:
            keep = [sys.executable, "-m", "citer.cli.prefect_server", "keep", str(sock.fileno()), str(owner_pid),
                    owner_start, str(reg), str(reg_dir / f"{key}.log")]  # fmt: skip
            launcher = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, *keep], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, pass_fds=(sock.fileno(),),
            )  # fmt: skip
            assert launcher.stdout is not None
            line = launcher.stdout.readline()
            launcher.wait(timeout=30)
        finally:
            sock.close()
        keeper_pid = int(line)
        keeper = (keeper_pid, start_time(keeper_pid))
        tmp = reg.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": url, "keeper_pid": keeper[0], "keeper_start": keeper[1]}))
        tmp.replace(reg)
    _STATE.update(keeper=keeper, booting=True)
    _use(url)


def _prune(reg_dir: Path, keep: Path) -> None:
    """Registry files of other repros whose keeper is gone (a SIGKILLed keeper cannot remove its own)."""
    from citer.ops.reaper import alive

    for path in reg_dir.glob("dvc-*.json"):
        if path == keep:  # this repro's: its lock is held now, and its entry is about to be replaced
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(path.read_text())
            if not alive(info["keeper_pid"], info["keeper_start"]):
                path.unlink()
                path.with_suffix(".lock").unlink(missing_ok=True)
                path.with_suffix(".log").unlink(missing_ok=True)


def _die_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when its parent (the keeper) dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def keep(fd: int, owner_pid: int, owner_start: str, registry: str, log: str, poll_s: float = 0.5) -> None:
    """The keeper of a repro's server: run it on socket ``fd`` until the ``dvc`` process (``owner_pid`` started at
    ``owner_start``) is gone, or the server is, or the keeper is told to stop; then stop it and unregister."""
    from citer.ops.reaper import alive

    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _f: stopping.append(signum))
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            server_command(fd),
            env=server_env(),
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            preexec_fn=_die_with_parent,  # a SIGKILLed keeper takes its server with it
        )
    os.close(fd)
    try:
        while not stopping and proc.poll() is None and alive(owner_pid, owner_start):
            time.sleep(poll_s)
    finally:
        _terminate(proc)
        with contextlib.suppress(OSError, ValueError):
            if json.loads(Path(registry).read_text()).get("keeper_pid") == os.getpid():
                Path(registry).unlink()
                Path(registry).with_suffix(".lock").unlink()  # no stage of that repro is left to take it
        if proc.returncode in (0, -signal.SIGTERM, -signal.SIGKILL):  # else its log says why it died
            with contextlib.suppress(OSError):
                Path(log).unlink()


if __name__ == "__main__":  # pragma: no cover - the keeper process
    if sys.argv[1] == "keep":
        keep(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
