"""THE server launcher: the `python -m sglang.launch_server` command line, and a server process that is always
stopped, for the CPU server tests, the benchmarks (driver, gpu_e2e) and `sglang-dflash serve`.

A server runs in its own session (process group) and is stopped by signalling that group by PID (TERM, then KILL):
SGLang starts scheduler and detokenizer children, and killing the launcher alone would leave them running.
(launch/common.sh builds the same command in shell: see docs/ARCHITECTURE.md.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..serving.plugin import WORKER_ENV

__all__ = ["WORKER_ENV", "Server", "free_port", "launch_server", "port_in_use", "process_tree", "server_argv",
           "worker_env"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on host:port right now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def process_tree(pid: int) -> list[int]:
    """pid and every process descended from it, or also in its process group (the launcher leads its group,
    `Server.start`): what must be gone once a server is stopped. psutil, which SGLang already depends on."""
    import psutil

    tree = set()
    try:
        root = psutil.Process(pid)
        tree = {pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.Error:
        pass
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pid:
                tree.add(p.pid)
        except OSError:
            continue
    return sorted(tree)


def server_argv(model_path: str | Path, port: int, host: str = "127.0.0.1", args: list[str] = (),
                python: str = sys.executable) -> list[str]:
    """The one `launch_server` command line: model, host, port, then `args` as given."""
    return [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", host,
            "--port", str(port), *args]


def worker_env(env: dict, builtin: bool) -> dict:
    """`env` with the plugin's worker switch set to SGLang's builtin worker, or removed (our worker)."""
    env = dict(env)
    if builtin:
        env[WORKER_ENV] = "builtin"
    else:
        env.pop(WORKER_ENV, None)
    return env


class Server:
    """One launch_server process in its own process group; `stop()` kills that group by PID. Its output goes to
    log_path, or to this process's stdout / stderr when log_path is None; pipe=True (no log_path): to two pipes,
    `proc.stdout` and `proc.stderr`, for the caller to relay (`sglang-dflash serve` filters them)."""

    def __init__(self, argv: list[str], log_path: str | Path | None, port: int, host: str = "127.0.0.1",
                 env: dict | None = None, pipe: bool = False):
        self.argv, self.port, self.host, self.env = list(argv), port, host, env
        self.log_path = Path(log_path) if log_path is not None else None
        if pipe and log_path is not None:
            raise ValueError("Server(pipe=True) relays the output itself: pass log_path=None")
        self.pipe = pipe
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> Server:
        """Start the process and return at once (wait with `wait_healthy`). Refuses a port that something already
        listens on: `wait_healthy` would take that process's /health for this server's."""
        if port_in_use(self.host, self.port):
            raise RuntimeError(f"port {self.port} on {self.host} is already in use (another server still running?), "
                               f"so this server's health check would talk to it. Fix: stop it (`ss -ltnp | grep "
                               f":{self.port}` shows its PID) or use another port (tests: SGLANG_DFLASH_TEST_PORT_OFFSET)")
        if self.log_path is None:
            pipe = subprocess.PIPE if self.pipe else None
            env = self.env
            if self.pipe:  # Python block-buffers a pipe: unbuffered, the relay sees each line when it is written
                env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True, stdout=pipe, stderr=pipe)
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None:
            return "<the server's output went to the terminal>"
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def healthy(self) -> bool:
        """Whether /health answers 200 right now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Poll /health until it answers 200; returns the seconds waited. Raises RuntimeError if the process exits
        first, TimeoutError after timeout_s; both messages end with the log tail."""
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if not self.alive():
                code = self.proc.returncode if self.proc else "never started"
                raise RuntimeError(f"server exited with {code} before /health; log tail:\n{self.log_tail()}")
            if self.healthy():
                return time.time() - t0
            time.sleep(poll_s)
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0, first: int = signal.SIGTERM, leader_first: bool = False) -> None:
        """Signal the process group with `first` (TERM), then TERM, then KILL, each after grace_s without the group
        gone, and reap the leader. leader_first (serve's Ctrl-C: first=INT): `first` goes to the launcher alone,
        then the group is stopped as above once the launcher has exited (or after grace_s). SGLang's launcher
        handles SIGINT by stopping its own children (SIGKILL from its kill_process_tree, or their parent-death
        signal): they exit without the KeyboardInterrupt tracebacks a group-wide SIGINT makes each of them print."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session=True: the server leads its own group
        if leader_first and self.proc.poll() is None:
            try:
                os.kill(pgid, first)
                self.proc.wait(timeout=grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            first = signal.SIGTERM  # what is left of the group (nothing, normally)

        def group_gone() -> bool:
            self.proc.poll()  # reap the leader: a zombie still counts as a member of its group
            try:
                os.killpg(pgid, 0)
                return False
            except ProcessLookupError:
                return True

        steps = [(first, grace_s)] + ([(signal.SIGTERM, grace_s)] if first != signal.SIGTERM else [])
        for sig, wait_s in steps + [(signal.SIGKILL, 10.0)]:
            if group_gone():
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            t0 = time.time()
            while time.time() - t0 < wait_s and not group_gone():
                time.sleep(0.2)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def launch_server(model_path: str | Path, port: int, log_path: str | Path, extra_args: list[str] = (),
                  env: dict | None = None, host: str = "127.0.0.1") -> Server:
    """Start `python -m sglang.launch_server` (own process group) and return at once."""
    return Server(server_argv(model_path, port, host, list(extra_args)), log_path, port, host, env).start()
