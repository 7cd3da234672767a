"""deploy/k8s: every overlay renders with ``kubectl kustomize``, every object it renders
passes kubernetes-validate's strict schemas, and every Megha container is a command the
CLI's own parser takes, naming ids and ports of the federation file its ConfigMap holds,
probed over gRPC health and run as non-root. Offline: nothing here reaches a cluster."""

from __future__ import annotations

import functools
import posixpath
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from services.cli import build_parser
from services.common.config import FederationConfig, parse_config

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# The schemas to validate against: StatefulSet ordinals (the LMs' pod names) are GA in
# 1.31, grpc probes in 1.27; kubernetes-validate ships schemas up to its own version.
KUBERNETES_VERSION = "1.31"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
HEALTHCHECK = "/usr/local/share/megha/healthcheck.py"
KUBECTL = shutil.which("kubectl")

needs_kubectl = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl (with its built-in kustomize) is not installed: deploy/k8s is not "
    "rendered (the machine image ships it; .ci/run tries apt-get)",
)
pytestmark = needs_kubectl


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    assert KUBECTL is not None
    done = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"kubectl kustomize overlays/{overlay}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def named(objects: tuple[dict, ...], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@dataclass
class Pod:
    """One pod a workload runs: its name (a StatefulSet's by ordinal, else the
    workload's) and its template's spec."""

    workload: dict
    name: str
    spec: dict

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"].get("labels", {})

    def containers(self, init: bool = True) -> list[dict]:
        return [*(self.spec.get("initContainers", []) if init else []), *self.spec["containers"]]


def pods(objects: tuple[dict, ...]) -> Iterator[Pod]:
    for o in objects:
        if o["kind"] not in WORKLOADS:
            continue
        spec = o["spec"]["template"]["spec"]
        name = o["metadata"]["name"]
        if o["kind"] == "StatefulSet":
            start = o["spec"].get("ordinals", {}).get("start", 0)
            for ordinal in range(start, start + o["spec"].get("replicas", 1)):
                yield Pod(o, f"{name}-{ordinal}", spec)
        else:
            yield Pod(o, name, spec)


def argv(container: dict, pod_name: str) -> list[str]:
    """The container's command line as the kubelet runs it: ``$(VAR)`` expanded from
    its env (a downward-API metadata.name is the pod's name)."""
    values = {}
    for var in container.get("env", []):
        if "value" in var:
            values[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            values[var["name"]] = pod_name
    words = [*container.get("command", []), *container.get("args", [])]
    return [re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), w) for w in words]


def literal_env(container: dict) -> dict[str, str]:
    return {v["name"]: v["value"] for v in container.get("env", []) if "value" in v}


def is_megha(container: dict) -> bool:
    return container.get("command", [None])[0] == "megha"


def federation_of(objects: tuple[dict, ...], pod: Pod, container: dict, path: str) -> str:
    """The federation file at ``path`` in this container: the text of the ConfigMap key
    mounted there."""
    directory, filename = posixpath.split(path)
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    assert directory in mounts, f"{pod.name}/{container['name']}: nothing mounted at {directory}"
    volume = next(v for v in pod.spec.get("volumes", []) if v["name"] == mounts[directory])
    assert "configMap" in volume, f"{pod.name}: {directory} is no ConfigMap"
    config_map = named(objects, "ConfigMap")[volume["configMap"]["name"]]
    return config_map["data"][filename]


def container_ports(container: dict) -> dict[int, str]:
    return {p["containerPort"]: p.get("name", "") for p in container.get("ports", [])}


def probed_by_grpc_health(container: dict, port: int) -> list[str]:
    """What is wrong with the container's probes of the gRPC health of ``port``: a
    ``grpc:`` probe on it, or with mutual TLS (which the kubelet's grpc probes cannot
    speak) the image's healthcheck.py."""
    problems = []
    tls = "MEGHA_TLS" in literal_env(container)
    for kind in ("readinessProbe", "livenessProbe"):
        probe = container.get(kind)
        if probe is None:
            problems.append(f"no {kind}")
        elif tls:
            if HEALTHCHECK not in probe.get("exec", {}).get("command", []):
                problems.append(f"{kind} under TLS does not run {HEALTHCHECK}: {probe}")
        elif probe.get("grpc", {}).get("port") != port:
            problems.append(f"{kind} is no grpc probe of port {port}: {probe}")
    return problems


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_every_part(overlay):
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "ConfigMap"} <= kinds
    workloads = {o["metadata"]["name"] for o in objects if o["kind"] in WORKLOADS}
    assert {"gm-1", "gm-2", "lm", "rabbitmq", "workers-lm-1"} <= workloads
    assert all(
        o["metadata"].get("namespace") == "megha" for o in objects if o["kind"] != "Namespace"
    )


def test_there_are_dev_prod_and_tls_overlays():
    assert {"dev", "prod", "tls"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_the_kubernetes_schemas(overlay):
    failures = []
    for o in render(overlay):
        try:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        except Exception as err:  # a schema missing (SchemaNotFoundError) fails too
            failures.append(f"{o['kind']}/{o['metadata']['name']}: {err}")
    assert not failures, "\n".join(failures)


def test_strict_validation_refuses_a_field_kubernetes_does_not_know():
    deployment = next(o for o in render(OVERLAYS[0]) if o["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["comand"] = ["megha"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_megha_container_is_a_cli_command_of_the_federation_file(overlay):
    objects = render(overlay)
    services = named(objects, "Service")
    parser = build_parser()
    gms: dict[str, Pod] = {}
    lm_pods: dict[str, Pod] = {}
    worker_lms: list[str] = []
    predictors: list[str] = []
    configs: dict[str, FederationConfig] = {}
    for pod in pods(objects):
        for container in pod.containers():
            if not is_megha(container):
                continue
            where = f"overlays/{overlay}: {pod.name}/{container['name']}"
            words = argv(container, pod.name)[1:]  # the entrypoint is `megha`
            try:
                args = parser.parse_args(words)
            except SystemExit:
                pytest.fail(f"{where}: megha does not take {words}")
            assert args.config, f"{where}: no --config"
            text = federation_of(objects, pod, container, args.config)
            config = parse_config(yaml.safe_load(text), env=literal_env(container))
            configs[text] = config
            ports = container_ports(container)
            if args.command == "gm":
                entry = config.gm(args.id)
                gms[args.id] = pod
                assert pod.workload["kind"] == "Deployment", where
                assert pod.workload["spec"]["replicas"] == 1, f"{where}: one GM, one pod"
                service = services.get(entry.host)
                assert service, f"{where}: no Service {entry.host} (gms[].host)"
                assert selects(service["spec"]["selector"], pod.labels), where
                grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
                assert grpc["port"] == entry.port, f"{where}: Service port is not gms[].port"
                assert ports.get(entry.port) == grpc["targetPort"], where
            elif args.command == "lm":
                entry = config.lm(args.id)
                lm_pods[args.id] = pod
                assert args.id == pod.name, f"{where}: --id {args.id} is not the pod's name"
                service = services[pod.workload["spec"]["serviceName"]]
                assert service["spec"]["clusterIP"] == "None", (
                    f"{where}: LMs need a headless Service"
                )
                assert entry.host == f"{pod.name}.{service['metadata']['name']}", where
                assert entry.port in {p["port"] for p in service["spec"]["ports"]}, where
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert posixpath.dirname(entry.journal) in mounts, (
                    f"{where}: journal not on a volume"
                )
                claims = {
                    c["metadata"]["name"] for c in pod.workload["spec"]["volumeClaimTemplates"]
                }
                journal = next(
                    m["name"] for m in container["volumeMounts"]
                    if m["mountPath"] == posixpath.dirname(entry.journal)
                )  # fmt: skip
                assert journal in claims, (
                    f"{where}: the journal's volume is no PersistentVolumeClaim"
                )
            elif args.command == "worker":
                assert args.lm, f"{where}: a worker host names its LM (--lm)"
                config.lm(args.lm)
                worker_lms.append(args.lm)
                assert pod.workload["spec"]["replicas"] == 1, f"{where}: node ids would repeat"
                group = next(g for g in config.workers if g.lm == args.lm)
                entry = None
                if group.metrics_port:
                    assert group.metrics_port in ports, f"{where}: metrics port not declared"
            elif args.command == "predictor":
                entry = config.predictor
                assert entry is not None, f"{where}: the federation file has no predictor"
                predictors.append(pod.name)
            else:
                pytest.fail(f"{where}: megha {args.command} is no long-running role")
            if entry is not None:  # a gRPC server: its ports and probes
                assert entry.bind == "0.0.0.0", f"{where}: probes and peers dial the pod IP"
                assert entry.port in ports, f"{where}: port {entry.port} not declared"
                if entry.metrics_port:
                    assert entry.metrics_port in ports, f"{where}: metrics_port not declared"
                problems = probed_by_grpc_health(container, entry.port)
                assert not problems, f"{where}: {problems}"
    assert len(configs) == 1, f"overlays/{overlay}: containers read different federation files"
    (config,) = configs.values()
    assert set(gms) == set(config.gm_ids), "every GM of the file runs, once"
    assert set(lm_pods) == {m.id for m in config.lms}, "every LM of the file is a pod"
    assert sorted(worker_lms) == sorted(g.lm for g in config.workers), "one worker host per group"
    # The predictor is dialed on loopback: it must be a sidecar of every GM.
    assert config.predictor is not None and config.predictor.host == "127.0.0.1"
    assert sorted(predictors) == sorted(p.name for p in gms.values())
    broker = urlsplit(config.rabbitmq_url).hostname
    assert broker in services, f"rabbitmq_url names {broker}, no Service"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_as_non_root_with_limits(overlay):
    problems = []
    for pod in pods(render(overlay)):
        security = pod.spec.get("securityContext", {})
        if not security.get("runAsNonRoot") or security.get("runAsUser", 0) == 0:
            problems.append(f"{pod.name}: pod not runAsNonRoot with a non-zero runAsUser")
        if security.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{pod.name}: no RuntimeDefault seccomp profile")
        for c in pod.containers():
            own = c.get("securityContext", {})
            where = f"{pod.name}/{c['name']}"
            if own.get("runAsUser") == 0 or own.get("runAsNonRoot") is False:
                problems.append(f"{where}: runs as root")
            if own.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if own.get("capabilities", {}).get("drop") != ["ALL"] or own["capabilities"].get("add"):
                problems.append(f"{where}: does not drop ALL capabilities")
            if not own.get("readOnlyRootFilesystem"):
                problems.append(f"{where}: root filesystem writable")
            resources = c.get("resources", {})
            for part in ("requests", "limits"):
                if set(resources.get(part, {})) < {"cpu", "memory"}:
                    problems.append(f"{where}: no cpu and memory {part}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_workload_has_a_disruption_budget(overlay):
    objects = render(overlay)
    budgets = [
        b["spec"]["selector"]["matchLabels"] for b in named(objects, "PodDisruptionBudget").values()
    ]
    for o in objects:
        if o["kind"] in WORKLOADS:
            labels = o["spec"]["template"]["metadata"]["labels"]
            assert any(selects(b, labels) for b in budgets), f"{o['metadata']['name']}: no PDB"
