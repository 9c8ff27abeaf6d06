"""The one launcher of prefixgate's child processes.

Contract: `ProcessGroup(logdir, env=..., scrub_env=..., new_session=...)` starts named
child processes (`start(name, argv)`, or `start_prefixgate(name, *args)` for
`python -m prefixgate ARGS`: the command line users run, so a child runs exactly what
they run) and stops them together:

  * every child gets SIGTERM when this process dies, however it dies (Linux
    PR_SET_PDEATHSIG: `die_with_parent`, set by launch/with_parent.py, which then execs
    the child's command), so no fleet is ever orphaned;
  * with `logdir`, a child's stdout and stderr go to `logdir/NAME.log` (appended: a child
    restarted under the same name keeps one log); without, it shares this terminal;
  * `scrub_env`: no PREFIXGATE_* variable of this process reaches a child (its flags are
    explicit); `new_session`: children get their own session, so a Ctrl-C reaches them
    only through `stop` (in order) rather than all at once from the terminal;
  * `check_alive()` raises `ProcessExited` (name, exit code, log tail) for a child that
    exited; `await wait_serving(address, timeout_s)` returns once the gRPC health service
    at `address` says SERVING, failing early when a child exits;
  * `stop(timeout_s, first=(prefixes...), only=None)` sends SIGTERM (a graceful drain) to the
    children whose names start with one of `first`, waits up to `timeout_s`, kills what
    is left, then does the same for the rest; `signal(name, sig)` ends one child. Under
    `new_session` a SIGKILL goes to the child's whole process group: a child that runs
    processes of its own (vLLM's engine core and model workers) leaves none behind, where
    a SIGTERM lets the child stop them itself.

Torch-free, imports no command: libraries (emulate, bench) and tests launch through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal as signals
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ProcessExited", "ProcessGroup", "die_with_parent", "prefixgate_argv"]


def die_with_parent(parent_pid: int | None = None) -> None:
    """Get SIGTERM when the parent process dies, even by SIGKILL (Linux; a no-op elsewhere).
    With `parent_pid`, exit at once if that parent is already gone (it died before this
    call, when the signal could not be asked for yet). Runs in the child (launch/
    with_parent.py before it execs the child's command, or first thing in a
    multiprocessing target)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signals.SIGTERM)  # PR_SET_PDEATHSIG
    if parent_pid is not None and os.getppid() != parent_pid:
        raise SystemExit(0)


def prefixgate_argv(*args: str) -> list[str]:
    """The command line of `prefixgate ARGS` under this interpreter."""
    return [sys.executable, "-m", "prefixgate", *args]


class ProcessExited(RuntimeError):
    """A child exited while it was expected to run."""

    def __init__(self, name: str, returncode: int, log_tail: str) -> None:
        where = f":\n{log_tail}" if log_tail else " (its log is above)"
        super().__init__(f"{name} exited with code {returncode}{where}")
        self.name, self.returncode = name, returncode


class ProcessGroup:
    def __init__(self, logdir: Path | None = None, *, env: Mapping[str, str] | None = None,
                 scrub_env: bool = False, new_session: bool = False,
                 cwd: Path | None = None) -> None:
        self.logdir = Path(logdir) if logdir is not None else None
        base = dict(os.environ if env is None else env)
        if scrub_env:
            base = {k: v for k, v in base.items() if not k.startswith("PREFIXGATE_")}
        self.env = {**base, "PYTHONUNBUFFERED": "1"}
        self.new_session = new_session
        self.cwd = cwd
        self.procs: dict[str, subprocess.Popen] = {}

    # ---------------------------------------------------------------- starting

    def start(self, name: str, argv: Sequence[str], *,
              env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start `argv` as child `name` (`env`: variables added to the group's)."""
        if name in self.procs and self.procs[name].poll() is None:
            raise ValueError(f"a process named {name!r} is already running")
        out = None
        if self.logdir is not None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path(name), "a")  # noqa: SIM115 (the child holds it)
        try:
            # No preexec_fn (launch/with_parent.py says why): the guard execs `argv`.
            guarded = [sys.executable, "-m", "prefixgate.launch.with_parent", str(os.getpid()),
                       *argv]
            proc = subprocess.Popen(
                guarded, env={**self.env, **(env or {})}, cwd=self.cwd, stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                start_new_session=self.new_session)
        finally:
            if out is not None:
                out.close()
        self.procs[name] = proc
        return proc

    def start_prefixgate(self, name: str, *args: str,
                         env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start `prefixgate ARGS` as child `name`."""
        return self.start(name, prefixgate_argv(*args), env=env)

    # ---------------------------------------------------------------- watching

    def log_path(self, name: str) -> Path:
        if self.logdir is None:
            raise ValueError("this group's children log to the terminal")
        return self.logdir / f"{name}.log"

    def log_tail(self, name: str, num_chars: int = 2000) -> str:
        if self.logdir is None or not self.log_path(name).exists():
            return ""
        return self.log_path(name).read_text(errors="replace")[-num_chars:]

    def check_alive(self) -> None:
        """Raise ProcessExited for the first child that has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ProcessExited(name, proc.returncode, self.log_tail(name))

    async def wait_serving(self, address: str, timeout_s: float) -> None:
        """Return once the gRPC health service at `address` answers SERVING; raise
        ProcessExited as soon as a child exits, TimeoutError after `timeout_s`."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        # Short reconnect backoff: the server is expected to start listening any moment.
        options = [("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 500)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self.check_alive()
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                await asyncio.sleep(0.2)
        raise TimeoutError(f"{address} did not become healthy within {timeout_s:.0f} s")

    # ---------------------------------------------------------------- stopping

    def signal(self, name: str, sig: int = signals.SIGKILL, wait_s: float = 30) -> int:
        """Send `sig` to child `name`, wait for it to exit, forget it; its exit code. A
        child still running after `wait_s` is killed, then TimeoutExpired is raised."""
        proc = self.procs.pop(name)
        if proc.poll() is None:
            self._send(proc, sig)
        try:
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            self._send(proc, signals.SIGKILL)
            proc.wait(5)
            raise

    def _send(self, proc: subprocess.Popen, sig: int) -> None:
        if sig == signals.SIGKILL and self.new_session:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the child leads its own group (new session)
        else:
            proc.send_signal(sig)

    def stop(self, timeout_s: float = 15, first: Sequence[str] = (),
             only: Sequence[str] | None = None) -> None:
        """SIGTERM, wait up to `timeout_s`, SIGKILL: the children named with a prefix in
        `first` (e.g. the gateways, so that they drain before their workers go), then
        the rest; forgets them. `only`: just the children of these names."""
        names = [n for n in self.procs if only is None or n in only]
        leading = [n for n in names if n.startswith(tuple(first))] if first else []
        for batch in (leading, [n for n in names if n not in leading]):
            procs = [self.procs.pop(n) for n in batch]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            deadline = time.monotonic() + timeout_s
            for p in procs:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._send(p, signals.SIGKILL)
                    p.wait(5)
