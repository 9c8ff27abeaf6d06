"""Local vLLM servers as prefixgate workers: `prefixgate up --engine vllm` (and its tests and
benchmarks). Torch-free: vLLM runs from its own environment, named by its interpreter.

Contract
--------
`VLLMLaunch` (frozen) says how to start each server: the vLLM environment's `python`, the
model folder (the one the gateway resolves, weights materialised), the served model name,
vLLM's block size, dtype, KV cache size and extra arguments. `VLLMFleet(launch, group)`
starts `n` servers through a `launch.processes.ProcessGroup` (`start(n)`), each on free
ports with what the gateway needs switched on (prefix caching, cached-token usage, KV
events over ZMQ with a replay endpoint, prefixgate's KV connector), waits until every one answers `/health`
(`await wait_ready(timeout_s)`, a progress bar on stderr showing each server's latest
start-up step; a server that exits fails at once with its log's tail), and gives the
gateway's `--vllm-worker` forms (`worker_specs`). Stopping is the group's.

Why each setting:
  - KV events and their replay go over ipc:// sockets in a private (0700) directory, never
    TCP on every interface (vLLM binds its ZMQ publisher only on '*' or ipc://): their
    batches carry every block's token ids (tenants' prompts);
  - `--kv-transfer-config` loads prefixgate's connector (prefixgate/vllm_connector/), its
    ExportBlocks on the server's host at `export_port`: the server pulls prefixes from its
    peers and serves what it computed. vLLM imports it from this very prefixgate: the child
    gets PYTHONPATH naming a private directory that holds only a link to this `prefixgate`
    package (`connector_path`), so the connector always speaks the gateway's wire and
    nothing else of this environment (its torch) reaches vLLM's. The connector exports as
    the server's worker id in the gateway (`VLLMServer.worker_id`, the adapter's
    `worker_id_of(url)`): the holder a gateway's pull ticket names. `keyring`: a keyring
    file whose `@tickets` line (the gateways' public ticket key) the connector checks pull
    tickets with, named by path, never a key on the command line; "": tickets are not
    checked (loopback only). `credentials` (`up --secure`'s, security/local.py): each
    server gets files of its own in that private directory once its port, hence its
    worker id, is chosen (`issue_worker`: a keyring with its own key and the gateways'
    ticket key, 0600), so its export serves only pulls the gateway signed a ticket for
    (the gateway, holding the `@gateways` secret of the same directory, signs them for
    the servers it follows), and a certificate from that directory's CA naming its worker
    id: its export is served over mutual TLS (`grpcs://` in the gateway's --vllm-worker
    form: the gateway calls it with its client certificate), its pulls present that
    certificate, so a ticket is honoured only from the receiver it names, and they check
    the holder's certificate against the holder's worker id. `connector=False`: none;
  - `api_key`: vLLM's --api-key (from a variable, never on the command line), for
    `up --secure`; the gateway's adapter sends it;
  - the group scrubs PREFIXGATE_* variables: they are prefixgate's flags, not vLLM's;
  - `VLLM_CPU_OMP_THREADS_BIND` splits this host's CPUs between the servers (vLLM's CPU
    backend otherwise binds every server to the same first core); GPU builds ignore it;
  - `--kv-cache-memory-bytes`: vLLM's CPU backend otherwise reserves 92 % of the NUMA
    node's memory per server and refuses to start when that is not free;
  - block size 32: the CPU backend refuses sizes that are not a multiple of 32, and
    smaller blocks mean finer reuse (vLLM's CPU default is 128); the gateway's own block
    size may differ (engines/vllm_events.py maps any pair);
  - float32: the materialised checkpoints are float32 and vLLM would downcast them to
    bfloat16; in float32 its greedy replies equal transformers' and prefixgate's workers'
    (logprobs within 1e-5, tests/engines/test_vllm_runtime.py);
  - eager mode (no torch.compile): a server starts in about a minute instead of several
    on a small CPU host (`enforce_eager=False`: compiled steps).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prefixgate.launch.processes import ProcessExited, ProcessGroup
from prefixgate.vllm_connector.params import DEFAULT_STORE_MIB, connector_config

if TYPE_CHECKING:
    from prefixgate.security.local import LocalCredentials, WorkerFiles

__all__ = ["VLLMFleet", "VLLMLaunch", "VLLMServer", "connector_path", "cpu_binding",
           "start_fleet", "vllm_argv", "vllm_env"]

DEFAULT_BLOCK_SIZE = 32
DEFAULT_KV_CACHE_MIB = 1024
_EXCEPTION = re.compile(r"^(?:\(\S+ pid=\d+\) ERROR .*?\] )?(\w+(?:Error|Exception): .*)")
_LOG_PREFIX = re.compile(r"^(\(\S+ pid=\d+\) )?(INFO|WARNING|DEBUG|ERROR) [\d-]+ [\d:]+ \[[^]]+\] ")


@dataclass(frozen=True)
class VLLMLaunch:
    """How to start each vLLM server (sizes: tokens, bytes)."""

    python: str  # the interpreter of an environment with vLLM installed
    model_dir: Path
    served_model_name: str
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_MIB << 20
    max_model_len: int = 0  # 0: the model's own
    enforce_eager: bool = True
    extra_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    connector: bool = True  # prefixgate's KV connector (block transfer)
    connector_store_mib: int = DEFAULT_STORE_MIB  # its host store of computed blocks
    api_key: str = ""  # vLLM's --api-key ("": none)
    keyring: str = ""  # a keyring file with the '@tickets' line: exports need a ticket
    # `up --secure`'s credentials: each server's own keyring (and certificate) issued there
    credentials: LocalCredentials | None = None

    def check(self) -> None:
        """ValueError saying what to give when the vLLM environment is missing."""
        if not self.python:
            raise ValueError("name the python of an environment with vLLM installed: "
                             "--vllm-python PATH or PREFIXGATE_VLLM_PYTHON (docs/vllm.md "
                             "shows the install)")
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"--vllm-python {self.python}: not an executable file")


@dataclass(frozen=True)
class VLLMServer:
    """One started server's endpoints as the gateway reaches them."""

    name: str
    host: str
    port: int
    events_port: int
    replay_port: int
    export_port: int = 0  # the connector's ExportBlocks (0: no connector)
    # A private (0700) directory for the KV event sockets (ipc://); "": TCP on `host`
    # (vLLM binds its publisher only on '*' or ipc://: TCP is for a reachable host only).
    ipc_dir: str = ""
    api_key_file: str = ""  # a 0600 file holding its --api-key ("": none)
    # Without an ipc_dir, publish the events on TCP on every interface: only when asked,
    # since they carry every prompt's token ids (a host other machines must reach).
    events_on_all_interfaces: bool = False
    # Its own keyring and certificate (`VLLMLaunch.credentials`; None: the launch's keyring).
    files: WorkerFiles | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events(self) -> str:
        if self.ipc_dir:
            return f"ipc://{self.ipc_dir}/{self.name}-events"
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay(self) -> str:
        if self.ipc_dir:
            return f"ipc://{self.ipc_dir}/{self.name}-replay"
        return f"tcp://{self.host}:{self.replay_port}"

    def bind_events(self) -> tuple[str, str]:
        """The event and replay endpoints vLLM binds: the ipc sockets, else TCP on every
        interface (vLLM binds its publisher only there): only for hosts others reach."""
        if self.ipc_dir:
            return self.events, self.replay
        if not self.events_on_all_interfaces:
            raise ValueError(f"{self.name}: vLLM's KV events need an ipc_dir, or "
                             "events_on_all_interfaces to publish on TCP on every interface")
        return f"tcp://*:{self.events_port}", f"tcp://*:{self.replay_port}"

    @property
    def worker_id(self) -> str:
        """The id the gateway knows this server by when it follows it (engines/vllm.py)."""
        from prefixgate.engines.vllm import worker_id_of

        return worker_id_of(self.url)

    @property
    def export(self) -> str:
        """The connector's ExportBlocks as `grpc://HOST:PORT`, `grpcs://HOST:PORT` when it
        is served over TLS (its own certificate: `files`) ("": none)."""
        if not self.export_port:
            return ""
        return f"{'grpcs' if self.files is not None else 'grpc'}://{self.host}:{self.export_port}"

    @property
    def worker_spec(self) -> str:
        """The gateway's `--vllm-worker URL,EVENTS,REPLAY[,EXPORT][,key-file:PATH]` form."""
        key = f"key-file:{self.api_key_file}" if self.api_key_file else ""
        return ",".join(p for p in (self.url, self.events, self.replay, self.export, key) if p)


def vllm_argv(launch: VLLMLaunch, server: VLLMServer) -> list[str]:
    """The command line of one server (vLLM's OpenAI API server module: the `vllm`
    console script of some builds fails on its package metadata)."""
    endpoint, replay = server.bind_events()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": endpoint, "replay_endpoint": replay}
    argv = [launch.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(launch.model_dir), "--served-model-name", launch.served_model_name,
            "--host", launch.host, "--port", str(server.port),
            "--block-size", str(launch.block_size), "--dtype", launch.dtype,
            "--kv-cache-memory-bytes", str(launch.kv_cache_bytes),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events)]
    if launch.max_model_len:
        argv += ["--max-model-len", str(launch.max_model_len)]
    if launch.enforce_eager:
        argv.append("--enforce-eager")
    if launch.connector and server.export_port:
        files = server.files
        tls = (str(files.cert), str(files.key), str(files.ca)) if files else ("", "", "")
        argv += ["--kv-transfer-config", connector_config(
            server.export_port, server.host, launch.connector_store_mib, server.worker_id,
            str(files.keyring) if files is not None else launch.keyring, *tls)]
    return argv + list(launch.extra_args)


def vllm_env(launch: VLLMLaunch, path_dir: Path) -> dict[str, str]:
    """Variables a server needs beyond the group's: where its python finds the connector
    (`connector_path(path_dir)`), and its API key (VLLM_API_KEY: off the command line)."""
    env = {"PYTHONPATH": str(connector_path(path_dir))} if launch.connector else {}
    if launch.api_key:
        env["VLLM_API_KEY"] = launch.api_key
    return env


def connector_path(path_dir: Path) -> Path:
    """A directory holding only a link to this `prefixgate` package (for vLLM's PYTHONPATH:
    its connector, and no other package of this environment)."""
    import prefixgate

    path_dir.mkdir(parents=True, exist_ok=True)
    link = path_dir / "prefixgate"
    target = Path(prefixgate.__file__).resolve().parent
    if not link.is_symlink() or link.resolve() != target:
        link.unlink(missing_ok=True)
        link.symlink_to(target, target_is_directory=True)
    return path_dir


def cpu_binding(index: int, count: int, cpus: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for server `index` of `count`: this process's CPUs split
    into `count` contiguous shares (servers share CPUs when there are fewer CPUs than
    servers), as "0-3" or "5"."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if count >= len(cpus):
        share = [cpus[index % len(cpus)]]
    else:
        per, extra = divmod(len(cpus), count)
        start = index * per + min(index, extra)
        share = cpus[start:start + per + (1 if index < extra else 0)]
    return ",".join(str(c) for c in share)


@dataclass
class VLLMFleet:
    launch: VLLMLaunch
    group: ProcessGroup
    servers: list[VLLMServer] = field(default_factory=list)

    def start(self, n: int, name_prefix: str = "vllm-") -> list[VLLMServer]:
        """Start `n` servers on free ports (they start loading at once, in parallel)."""
        import tempfile

        from prefixgate.wire.rpc import free_port

        path_dir = (self.group.logdir or Path(tempfile.mkdtemp(prefix="prefixgate-vllm-"))) \
            / "pythonpath"
        ipc_dir = tempfile.mkdtemp(prefix="pg-vllm-")  # 0700: this user's processes only
        key_file = ""
        if self.launch.api_key:  # for the gateway's adapter: off every command line
            key_file = os.path.join(ipc_dir, "api-key")
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.launch.api_key)
        for i in range(n):
            server = VLLMServer(f"{name_prefix}{i}", self.launch.host, free_port(),
                                0, 0, free_port() if self.launch.connector else 0, ipc_dir,
                                key_file)
            if self.launch.credentials is not None and server.export_port:
                from prefixgate.security.local import issue_worker

                server = dataclasses.replace(server, files=issue_worker(
                    self.launch.credentials, server.worker_id))
            self.group.start(server.name, vllm_argv(self.launch, server),
                             env={"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(i, n),
                                  **vllm_env(self.launch, path_dir)})
            self.servers.append(server)
        return self.servers

    @property
    def worker_specs(self) -> list[str]:
        return [s.worker_spec for s in self.servers]

    def step(self, server: VLLMServer) -> str:
        """The server's latest start-up step: its log's last line, without vLLM's prefix."""
        if self.group.logdir is None:
            return ""
        lines = [ln for ln in self.group.log_tail(server.name, 8000).splitlines()
                 if _LOG_PREFIX.match(ln)]  # vLLM's own log lines, not libraries' warnings
        return _LOG_PREFIX.sub("", lines[-1]).strip()[:70] if lines else "starting"

    def cause(self, name: str) -> str:
        """Why server `name` failed: the first exception its log reports (vLLM's start-up
        failures end in a generic "Engine core initialization failed" after the real one)."""
        if self.group.logdir is None or not self.group.log_path(name).exists():
            return ""
        for line in self.group.log_path(name).read_text(errors="replace").splitlines():
            found = _EXCEPTION.match(line)
            if found and "Engine core initialization failed" not in line:
                return found.group(1).strip()
        return ""

    async def wait_ready(self, timeout_s: float, progress: bool = True) -> None:
        """Return once every server answers GET /health with 200. ProcessExited for a
        server that exits meanwhile; TimeoutError after `timeout_s`."""
        import aiohttp
        from tqdm import tqdm

        pending = list(self.servers)
        deadline = time.monotonic() + timeout_s
        bar = tqdm(total=len(pending), desc="vLLM servers ready", unit="server",
                   file=sys.stderr, disable=not progress,
                   bar_format="{desc}: {n}/{total} [{elapsed}]{postfix}")
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
                while pending:
                    self.group.check_alive()
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{', '.join(s.name for s in pending)} did not "
                                           f"answer /health within {timeout_s:.0f} s")
                    for server in list(pending):
                        try:
                            async with http.get(server.url + "/health") as resp:
                                if resp.status == 200:
                                    pending.remove(server)
                                    bar.update(1)
                        except (aiohttp.ClientError, asyncio.TimeoutError):
                            pass
                    if pending:
                        bar.set_postfix_str(f"{pending[0].name}: {self.step(pending[0])}")
                        await asyncio.sleep(0.5)
        finally:
            bar.close()



async def start_fleet(launch: VLLMLaunch, n: int, model: str, cache_dir: Path | None,
                      timeout_s: float, logdir: Path | None = None) -> VLLMFleet:
    """Materialise `model`'s folder (vLLM reads its weights itself; in a child process, so
    that torch stays out of this one), start `n` servers logging to `logdir` (default: a
    new temporary directory, named on stderr) and wait until they answer. On any failure
    the servers are stopped before the error (ValueError: no vLLM environment;
    ProcessExited; TimeoutError) is raised."""
    import logging
    import tempfile

    launch.check()
    logdir = logdir or Path(tempfile.mkdtemp(prefix="prefixgate-vllm-"))
    # vLLM gets no PREFIXGATE_* variable, and its own session: a Ctrl-C in the terminal
    # stops the gateway first, then (through stop) the servers.
    group = ProcessGroup(logdir, scrub_env=True, new_session=True)
    fleet = VLLMFleet(launch, group)
    try:
        prep = ProcessGroup(logdir, scrub_env=True)
        proc = prep.start("materialise", [sys.executable, "-m", "prefixgate.worker.model_loader",
                                          model, *([str(cache_dir)] if cache_dir else [])])
        if await asyncio.to_thread(proc.wait) != 0:
            prep.check_alive()  # raises ProcessExited with the log's tail
        fleet.start(n)
        logging.getLogger(__name__).info("starting %d vLLM servers (%s); their logs: %s", n,
                                         launch.model_dir, logdir)
        await fleet.wait_ready(timeout_s)
    except ProcessExited as exc:
        await asyncio.to_thread(group.stop, 30)
        if exc.name in {s.name for s in fleet.servers}:  # say why, not vLLM's last words
            raise ProcessExited(exc.name, exc.returncode, f"{fleet.cause(exc.name)}\n(its log: "
                                f"{group.log_path(exc.name)})") from None
        raise
    except BaseException:
        await asyncio.to_thread(group.stop, 30)
        raise
    return fleet
