"""`prefixgate up`: N workers (subprocesses) and a gateway (in this process) on this machine.

Ctrl-C (or SIGTERM) stops every process it started, in order and saying what it waits for:
the gateway lets the replies in flight finish (up to its drain time), then the workers
stop; a second Ctrl-C stops everything at once (`CtrlC`). The workers run in a session of
their own, so the terminal's Ctrl-C reaches `up` alone (a worker stopping by itself would
end replies the gateway still streams); they also get SIGTERM when `up` dies by SIGKILL
(Linux). Once up it prints how to reach it: the chat command, and with the HTTP API its
URL, a curl line and the OpenAI SDK's variables (with --secure the CA they must trust:
SSL_CERT_FILE, curl --cacert). What could fail late fails first: the gateway's ports are
checked free and Redis (--redis-url) reachable before any model loads. Workers get their
flags explicitly (no PREFIXGATE_* variable of `up`'s reaches them: one meant for `up`,
say PREFIXGATE_METRICS_PORT, would have every worker fight for it) and a metrics port
each, printed. `up` says it is up only once the gateway routes to every worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import time

from prefixgate.cli import gateway as gateway_cli
from prefixgate.cli import worker as worker_cli
from prefixgate.cli.common import (
    cache_dir,
    listen_flags,
    log,
    log_flags,
    model_flags,
    overflow_flag,
    redis_url_flag,
    tracing_flag,
)
from prefixgate.cli.flags import flag

HELP = "run N workers and a gateway on this machine"
DESCRIPTION = ("Start N workers and a gateway on this machine; Ctrl-C stops every process "
               "it started.")

DEMO_SCRIPT = (
    "What is the capital of France?",
    "What is a famous museum there?",
    "Thanks! Summarise our conversation in one sentence.",
)


def add_arguments(u: argparse.ArgumentParser) -> None:
    log_flags(u)
    model_flags(u)
    flag(u, "--workers", type=int, default=2, help="number of workers")
    listen_flags(u, 50051, "gateway ")
    redis_url_flag(u, "use this Redis as the registry (default: embedded, no Redis)")
    gateway_cli.policy_flags(u)
    overflow_flag(u)
    gateway_cli.http_flag(u, 8000)
    gateway_cli.record_trace_flag(u)
    gateway_cli.processes_flag(u)
    tracing_flag(u)
    flag(u, "--torch-threads", type=int, default=0,
         help="torch threads per worker (0: CPU count / workers)")
    worker_cli.weights_flags(u)
    flag(u, "--demo", action="store_true",
         help="hold the scripted demo chat through the gateway, print it, then stop")
    flag(u, "--secure", action="store_true",
         help="make fresh local credentials (a CA, certificates, a client token, the "
              "internal credential, per-worker keys) and run everything with them: TLS and "
              "a bearer token on the gateway, mutual TLS and the internal credential to "
              "the workers (prefixgate/security/local.py)")
    flag(u, "--secure-dir", default="",
         help="where --secure writes the credentials, private to you (default: "
              "<cache dir>/secure; replaced on each start)")
    flag(u, "--startup-timeout", type=float, default=900.0,
         help="seconds to wait for workers to load the model")
    flag(u, "--engine", default="prefixgate", choices=("prefixgate", "vllm"),
         help="prefixgate: prefixgate's own workers; vllm: N local vLLM servers (from "
              "--vllm-python's environment) as the workers (docs/vllm.md)")
    vllm_flags(u)


def vllm_flags(u: argparse.ArgumentParser) -> None:
    """How `--engine vllm` starts its servers (prefixgate/launch/vllm.py says why)."""
    from prefixgate.launch import vllm

    flag(u, "--vllm-python", default="",
         help="--engine vllm: the python of an environment with vLLM installed")
    flag(u, "--vllm-block-size", type=int, default=vllm.DEFAULT_BLOCK_SIZE,
         help="--engine vllm: vLLM's KV block size in tokens (its CPU backend needs a "
              "multiple of 32)")
    flag(u, "--vllm-dtype", default="float32",
         help="--engine vllm: vLLM's --dtype (float32: the replies of prefixgate's workers)")
    flag(u, "--vllm-kv-cache-mib", type=int, default=vllm.DEFAULT_KV_CACHE_MIB,
         help="--engine vllm: KV cache per server, MiB")
    flag(u, "--vllm-compile", action="store_true",
         help="--engine vllm: compiled model steps (starts take minutes on a CPU; default "
              "eager)")
    flag(u, "--vllm-args", default="", help="--engine vllm: more arguments for every vLLM "
                                            "server, as one shell-quoted string")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_up_until_stopped(args))


class CtrlC:
    """What SIGINT and SIGTERM do to `up` (install inside the running loop).

    Before `up` is up, the first one cancels `main` (the start-up; nothing is in flight).
    Once up, the first one sets `stop`, and `up` stops in order; it says how many replies
    the gateway waits for and for how long. The next one sets `hurry`: `unless_hurried`
    cancels what it waits on, `grace` becomes 0, and every process in `children` is killed
    (each leads its own process group: nothing it started survives)."""

    def __init__(self) -> None:
        import signal

        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self.main: asyncio.Task | None = None
        self.up = False
        self.drain_seconds = 0.0
        self.children: list = []  # subprocess.Popen, each leading its process group
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signal)

    def _signal(self) -> None:
        if not self.stop.is_set():
            self.stop.set()
            if not self.up:
                _say("stopping (it was starting); Ctrl-C again stops at once")
                if self.main is not None:
                    self.main.cancel()
                return
            from prefixgate.gateway import metrics

            in_flight = round(sum(s.value for m in metrics.IN_FLIGHT.collect()
                                  for s in m.samples))
            replies = "1 reply" if in_flight == 1 else f"{in_flight} replies"
            waits = (f"the gateway lets {replies} in flight finish (up to "
                     f"{self.drain_seconds:.0f} s), then " if in_flight else "")
            _say(f"stopping: {waits}the workers stop; Ctrl-C again stops at once")
            return
        if not self.hurry.is_set():
            self.hurry.set()
            _say("stopping at once")
            self.kill()

    def kill(self) -> None:
        import contextlib
        import signal

        for proc in self.children:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

    def grace(self, seconds: float) -> float:
        return 0.0 if self.hurry.is_set() else seconds

    async def unless_hurried(self, task: asyncio.Task) -> None:
        """Wait for `task`; cancel it (and wait for that) if hurried first."""
        import contextlib

        hurry = asyncio.create_task(self.hurry.wait())
        try:
            await asyncio.wait({task, hurry}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurry.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _say(text: str) -> None:
    print(f"prefixgate up: {text}", file=sys.stderr, flush=True)


async def _up_until_stopped(args: argparse.Namespace) -> int:
    ctrl_c = CtrlC()
    ctrl_c.main = asyncio.create_task(_up(args, ctrl_c))
    try:
        return await ctrl_c.main
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # this task itself was cancelled
            raise
        return 130  # Ctrl-C during start-up


def _refuse_busy(host: str, port: int, flag_name: str) -> None:
    """refuse_busy_port, its message naming the flag that chooses another port."""
    from prefixgate.gateway.processes import refuse_busy_port
    from prefixgate.wire.rpc import BindError

    try:
        refuse_busy_port(host, port)
    except BindError as exc:
        off = "; -1: no HTTP API" if flag_name == "--http-port" else ""
        raise BindError(f"{exc} (choose with {flag_name} PORT; 0: any free port{off})"
                        ) from None


def _reach_lines(address: str, http_url: str, creds) -> list[str]:
    """How to reach the gateway `up` started: chat; with the HTTP API, curl and the
    OpenAI SDK (with --secure: the CA they must trust and the token they must send)."""
    secured = f" --tls-ca {creds.ca} --token-file {creds.token}" if creds is not None else ""
    lines = [f"  chat:       prefixgate chat --address {address}{secured}"]
    if http_url and creds is not None:
        auth = f'-H "Authorization: Bearer $(cat {creds.token})" '
        lines += [f"  curl:       curl --cacert {creds.ca} {auth}{http_url}/models",
                  f"  OpenAI SDK: SSL_CERT_FILE={creds.ca} OPENAI_BASE_URL={http_url} "
                  f"OPENAI_API_KEY=$(cat {creds.token}) python your_app.py"]
    elif http_url:
        lines += [f"  curl:       curl {http_url}/models",
                  f"  OpenAI SDK: OPENAI_BASE_URL={http_url} OPENAI_API_KEY=unused "
                  "python your_app.py"]
    return lines


async def _up(args: argparse.Namespace, ctrl_c: CtrlC) -> int:
    from prefixgate.launch.processes import ProcessExited, ProcessGroup
    from prefixgate.launch.serving import start_server
    from prefixgate.wire.rpc import free_port

    n = args.workers
    if n < 1:
        raise SystemExit("prefixgate up: --workers must be at least 1")
    # Before any model loads (minutes, the first time): ports taken, Redis not there.
    _refuse_busy(args.host, args.port, "--port")
    if args.http_port == 0:  # chosen now, so that the URL printed is the one served
        args.http_port = free_port(args.host)
    _refuse_busy(args.host, max(0, args.http_port), "--http-port")
    if args.redis_url:
        from prefixgate.registry.redis_registry import check_reachable

        try:
            await check_reachable(args.redis_url)
        except ConnectionError as exc:
            raise SystemExit(f"prefixgate up: {exc}") from None
    if args.engine == "vllm" and args.secure and args.redis_url:
        raise SystemExit("prefixgate up: --secure with --engine vllm and --redis-url is not "
                         "offered (the per-server worker processes would need certificates); "
                         "drop --redis-url: the gateway then follows the servers itself")
    creds = _credentials(args, [f"worker-{i}" for i in range(n)]) if args.secure else None
    probes = []  # where each worker's health is asked (its plaintext health port if TLS)
    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // n)
    # They log to this terminal; their flags are all explicit; the terminal's Ctrl-C
    # reaches `up` alone, which stops them once the gateway has drained (CtrlC).
    workers = ProcessGroup(scrub_env=True, new_session=True)
    addresses = []
    metrics = []  # each worker's Prometheus port
    stop = ctrl_c.stop
    vllm = None
    try:
        for i in range(0 if args.engine == "vllm" else n):
            port = free_port()
            addresses.append(f"127.0.0.1:{port}")
            metrics.append(free_port())
            cmd = ["worker", "--model", args.model,
                   "--port", str(port), "--worker-id", f"worker-{i}",
                   "--metrics-port", str(metrics[-1]), "--otel-traces", args.otel_traces,
                   "--torch-threads", str(threads), "--block-size", str(args.block_size),
                   "--context-overflow", args.context_overflow,
                   "--weights", args.weights, "--kv-dtype", args.kv_dtype,
                   "--log-level", args.log_level, "--log-format", args.log_format]
            if args.cache_dir:
                cmd += ["--cache-dir", args.cache_dir]
            if args.redis_url:
                cmd += ["--redis-url", args.redis_url]
            probes.append(addresses[-1])
            if creds is not None:
                probes[-1] = f"127.0.0.1:{free_port()}"
                cmd += ["--tls-cert", str(creds.server_cert), "--tls-key", str(creds.server_key),
                        "--tls-client-ca", str(creds.ca),
                        "--internal-token-file", str(creds.internal_token),
                        "--health-port", probes[-1].rsplit(":", 1)[1],
                        # Block pulls and the drain hand-off call peers as gateways do.
                        "--peer-tls-ca", str(creds.ca), "--peer-tls-cert",
                        str(creds.client_cert), "--peer-tls-key", str(creds.client_key)]
                if args.redis_url:
                    cmd += ["--worker-keyring", str(creds.worker_keyring(f"worker-{i}"))]
            workers.start_prefixgate(f"worker-{i}", *cmd)
        if args.engine == "vllm":
            vllm = await _start_vllm(args, workers, addresses, creds)
            probes += addresses
        else:
            log.info("starting %d workers (%s); the first start of a model may take a "
                     "minute", n, args.model)
        deadline = time.monotonic() + args.startup_timeout
        for address in probes:
            try:
                await workers.wait_serving(address, max(0.0, deadline - time.monotonic()))
            except ProcessExited as exc:
                raise SystemExit(f"prefixgate up: {exc} during start-up") from None
            except TimeoutError:
                raise SystemExit(f"prefixgate up: {address} did not become healthy in time"
                                 ) from None
        from prefixgate.gateway.startup import run_gateway

        static = [] if args.redis_url else addresses
        startup = gateway_cli.gateway_startup(args, static, args.port)
        if creds is not None:
            # The gateway's keyring: to verify registrations in Redis, and to sign the
            # pull tickets of the vLLM servers it follows itself.
            startup = dataclasses.replace(startup, config=_secured(
                startup.config, creds, bool(args.redis_url) or args.engine == "vllm"))
        gw_stop = asyncio.Event()
        ctrl_c.drain_seconds = startup.config.drain_seconds
        if args.processes > 1:  # shared ports: refuse a busy one before the first bind
            from prefixgate.gateway.processes import refuse_busy_ports

            refuse_busy_ports(startup.config)
        gateway, port = await start_server(lambda started: run_gateway(startup, gw_stop,
                                                                       started))
        extra: list = []  # the other --processes gateway processes, on the same port
        try:
            address = f"{args.host}:{port}"
            if args.processes > 1:
                from prefixgate.gateway import processes
                from prefixgate.gateway.startup import serve_process

                child = dataclasses.replace(startup, config=dataclasses.replace(
                    startup.config, port=port))
                extra = processes.spawn(serve_process, child, args.processes - 1)
                await asyncio.to_thread(processes.wait_ready, extra, args.startup_timeout)
            await _wait_routable(address, n, 60.0, args.redis_url, creds)
            ctrl_c.up = True
            log.info("prefixgate is up: gateway %s, workers %s (metrics: %s)", address,
                     ", ".join(addresses or vllm.worker_specs), ", ".join(
                         [f"http://127.0.0.1:{p}/metrics" for p in metrics]
                         or [s.url + "/metrics" for s in vllm.servers]))
            if args.demo:
                # The demo prints each turn's figures itself; keep the terminal readable.
                for name in ("prefixgate.gateway", "prefixgate.turns"):
                    logging.getLogger(name).setLevel(logging.WARNING)
                return await _demo(address, n, creds)
            scheme = "https" if creds is not None else "http"
            http_url = (f"{scheme}://{args.host}:{args.http_port}/v1" if args.http_port > 0
                        else "")
            http = f"; OpenAI-compatible API on {http_url}" if http_url else ""
            print("\n".join([f"prefixgate up: gateway on {address}{http}   (Ctrl-C stops "
                             "everything)", *_reach_lines(address, http_url, creds)]),
                  file=sys.stderr, flush=True)
            await stop.wait()
            return 0
        finally:
            if extra:
                await asyncio.to_thread(processes.stop, extra, ctrl_c.grace(15))
            gw_stop.set()
            await ctrl_c.unless_hurried(gateway)
    finally:
        ctrl_c.children += [*workers.procs.values(),
                            *(vllm.group.procs.values() if vllm is not None else ())]
        if ctrl_c.hurry.is_set():
            ctrl_c.kill()
        elif ctrl_c.up:
            _say("stopping the workers")
        await asyncio.to_thread(workers.stop, ctrl_c.grace(15))
        if vllm is not None:
            await asyncio.to_thread(vllm.group.stop, ctrl_c.grace(30))


async def _start_vllm(args: argparse.Namespace, sidecars, addresses: list[str], creds=None):
    """N local vLLM servers (launch/vllm.py) as the workers: followed from the gateway's
    process (args.vllm_worker), or, with --redis-url, through one `prefixgate worker
    --engine vllm` each (started in `sidecars`, their addresses appended to `addresses`).
    With --secure (`creds`) each server's connector gets its own keyring and certificate
    there."""
    import secrets
    import shlex

    from prefixgate.launch.processes import ProcessExited
    from prefixgate.launch.vllm import VLLMLaunch, start_fleet
    from prefixgate.model.catalog import resolve_model
    from prefixgate.wire.rpc import free_port

    spec = resolve_model(args.model, cache_dir(args))
    launch = VLLMLaunch(python=args.vllm_python, model_dir=spec.model_dir,
                        served_model_name=spec.name, block_size=args.vllm_block_size,
                        dtype=args.vllm_dtype, kv_cache_bytes=args.vllm_kv_cache_mib << 20,
                        enforce_eager=not args.vllm_compile,
                        extra_args=tuple(shlex.split(args.vllm_args)),
                        api_key=secrets.token_urlsafe(32) if args.secure else "",
                        credentials=creds)
    try:
        fleet = await start_fleet(launch, args.workers, args.model, cache_dir(args),
                                  args.startup_timeout)
    except ValueError as exc:
        raise SystemExit(f"prefixgate up --engine vllm: {exc}") from None
    except (ProcessExited, TimeoutError) as exc:
        raise SystemExit(f"prefixgate up: {exc} during start-up") from None
    if not args.redis_url:
        args.vllm_worker = fleet.worker_specs
        return fleet
    for server in fleet.servers:  # the Kubernetes form: a worker process per server
        name, port = server.name.replace("vllm", "worker"), free_port()
        addresses.append(f"127.0.0.1:{port}")
        sidecars.start_prefixgate(
            name, "worker", "--engine", "vllm", "--model", args.model, "--port", str(port),
            "--worker-id", name, "--block-size", str(args.block_size),
            "--redis-url", args.redis_url, "--vllm-url", server.url,
            "--vllm-events", server.events, "--vllm-replay", server.replay,
            *(["--vllm-export", server.export.removeprefix("grpc://")] if server.export else []),
            "--log-level", args.log_level, "--log-format", args.log_format,
            *(["--cache-dir", args.cache_dir] if args.cache_dir else []))
    return fleet


def _credentials(args: argparse.Namespace, worker_ids: list[str]):
    """Fresh local credentials for `up --secure` (prefixgate.security.local)."""
    from pathlib import Path

    from prefixgate.model.catalog import default_cache_dir
    from prefixgate.security.local import make_local_credentials

    directory = Path(args.secure_dir) if args.secure_dir else (
        Path(args.cache_dir) if args.cache_dir else default_cache_dir()) / "secure"
    creds = make_local_credentials(directory, worker_ids)
    log.info("secured: credentials in %s (TLS with its ca.crt, the bearer token in its "
             "token file)", directory)
    return creds


def _secured(config, creds, with_keyring: bool):
    """`config` (GatewayConfig) with `up --secure`'s TLS, tokens, internal credential and,
    `with_keyring`, its keyring (the workers' public keys, the gateways' secret)."""
    from prefixgate.security.auth import AuthConfig
    from prefixgate.wire.rpc import TLSConfig

    return dataclasses.replace(
        config, tls=TLSConfig(str(creds.server_cert), str(creds.server_key)),
        worker_tls=TLSConfig(str(creds.client_cert), str(creds.client_key), str(creds.ca)),
        auth=AuthConfig(tokens_file=str(creds.tokens),
                        internal_token_file=str(creds.internal_token),
                        worker_keyring_file=str(creds.gateway_keyring) if with_keyring else ""))


def _client(address: str, creds=None):
    """A ChatClient of the gateway `up` started (with `--secure`: its CA and token)."""
    from prefixgate.wire.client import ChatClient
    from prefixgate.wire.rpc import TLSConfig

    return (ChatClient(address) if creds is None else
            ChatClient(address, TLSConfig(ca_file=str(creds.ca)),
                       creds.token.read_text().strip()))


async def _wait_routable(address: str, num_workers: int, timeout_s: float,
                         redis_url: str, creds=None) -> None:
    """Return once the gateway at `address` routes to `num_workers` workers; otherwise
    exit saying how many it sees and where to look (never "up" with workers missing)."""
    from prefixgate.registry import redact_url

    client = _client(address, creds)
    try:
        await client.wait_ready(30)
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            seen = (await client.list_models()).models[0].num_workers
            if seen >= num_workers:
                return
            await asyncio.sleep(0.2)
    finally:
        await client.close()
    where = (f"the workers register in Redis at {redact_url(redis_url)}: can they and the "
             "gateway reach it?" if redis_url else "the gateway probes them at their "
             "addresses")
    raise SystemExit(f"prefixgate up: the gateway routes to {seen} of {num_workers} workers "
                     f"after {timeout_s:.0f} s ({where}; the log above says why)")


async def _demo(address: str, num_workers: int, creds=None) -> int:
    from prefixgate.cli.chat import converse

    client = _client(address, creds)  # it routes to every worker (_wait_routable)
    await client.wait_ready(30)
    results, _ = await converse(client, list(DEMO_SCRIPT), conversation_id="demo",
                             # Greedy: the demo's replies are the same every run.
                             system="", sampling_kwargs={"max_tokens": 96, "temperature": 0})
    await client.close()
    if len(results) < len(DEMO_SCRIPT):
        return 1
    first = results[0].text
    if "paris" not in first.lower():
        print(f"demo: the first reply does not mention Paris: {first!r}", file=sys.stderr)
        return 1
    return 0
