"""The chart's pods as containers: what `helm template` renders, started with podman or docker.

There is no Kubernetes scheduler here, so this module does the part of a kubelet the images
meet: each container gets exactly the environment (the ConfigMap, the Secret's Redis URL, the
pod's name from the downward API), the command and arguments, the user, the read-only root
filesystem with its writable volumes, the dropped capabilities and the read-only model
volume that the rendered manifest gives it, on a container network where the Services'
names resolve. Its probes are the manifest's, run from outside as the kubelet runs them
(HTTP GET on the named port, or the command inside the container). Nothing about a pod is
written here that the chart did not render, so the chart and the images cannot drift apart.

Left out: resources (requests and limits), node placement, the HPA and the PDBs (no
scheduler), the Service's load balancing (one API pod).
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "duplex"
COMPONENT = "app.kubernetes.io/component"


class Manifests:
    """One release as `helm template` renders it."""

    def __init__(self, text: str) -> None:
        self.docs = [doc for doc in yaml.safe_load_all(text) if doc]

    @classmethod
    def render(cls, helm: str, release: str, values: dict[str, Any]) -> Manifests:
        args = [helm, "template", release, str(CHART), "--values", "-"]
        done = subprocess.run(
            args, input=json.dumps(values), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise AssertionError(f"helm template failed: {done.stderr}")
        return cls(done.stdout)

    def _named(self, kind: str, name: str) -> dict[str, Any]:
        for doc in self.docs:
            if doc["kind"] == kind and doc["metadata"]["name"] == name:
                return doc
        raise KeyError(f"{kind}/{name} is not rendered")

    def workload(self, component: str) -> dict[str, Any]:
        """The Deployment or StatefulSet of a component (api, worker, redis)."""
        for doc in self.docs:
            labels = doc["metadata"].get("labels", {})
            if doc["kind"] in ("Deployment", "StatefulSet") and labels.get(COMPONENT) == component:
                return doc
        raise KeyError(f"no workload for {component}")

    def service(self, component: str) -> str:
        for doc in self.docs:
            labels = doc["metadata"].get("labels", {})
            if doc["kind"] == "Service" and labels.get(COMPONENT) == component:
                return str(doc["metadata"]["name"])
        raise KeyError(f"no service for {component}")

    def config_map(self, name: str) -> dict[str, str]:
        return {k: str(v) for k, v in self._named("ConfigMap", name).get("data", {}).items()}

    def secret(self, name: str, key: str) -> str:
        return str(self._named("Secret", name)["stringData"][key])


@dataclass
class Pod:
    """One pod of a workload, run as a container."""

    engine: str
    name: str
    #: what the manifest's container declares
    container: dict[str, Any]
    spec: dict[str, Any]
    args: list[str] = field(default_factory=list)

    def start(self) -> None:
        run = [self.engine, "run", "--detach", "--name", self.name, *self.args]
        done = subprocess.run(run, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise AssertionError(f"{self.name} did not start: {done.stderr}")

    @property
    def ip(self) -> str:
        out = subprocess.run(
            [self.engine, "inspect", "--format", "{{json .NetworkSettings.Networks}}", self.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return next(iter(json.loads(out).values()))["IPAddress"]

    def port(self, name_or_number: str | int) -> int:
        if isinstance(name_or_number, int):
            return name_or_number
        for port in self.container.get("ports", []):
            if port.get("name") == name_or_number:
                return int(port["containerPort"])
        raise KeyError(f"{self.name} declares no port {name_or_number}")

    def url(self, port: str | int, path: str = "") -> str:
        return f"http://{self.ip}:{self.port(port)}{path}"

    def probe(self, kind: str) -> bool:
        """One run of the manifest's probe (`startupProbe`, `readinessProbe`,
        `livenessProbe`) as the kubelet runs it."""
        probe = self.container[kind]
        if "httpGet" in probe:
            get = probe["httpGet"]
            try:
                with urllib.request.urlopen(self.url(get["port"], get["path"]), timeout=5) as r:
                    return 200 <= r.status < 400
            except (urllib.error.URLError, OSError):
                return False
        if "exec" in probe:
            done = subprocess.run(
                [self.engine, "exec", self.name, *probe["exec"]["command"]],
                capture_output=True,
                check=False,
            )
            return done.returncode == 0
        if "tcpSocket" in probe:
            try:
                with socket.create_connection((self.ip, self.port(probe["tcpSocket"]["port"])), 5):
                    return True
            except OSError:
                return False
        raise AssertionError(f"{self.name}: a probe of a kind not handled: {probe}")

    def wait_ready(self, timeout_s: float = 300) -> None:
        """The startup probe (where declared), then the readiness probe, polled at their
        periods until they pass; the container exiting first fails at once."""
        deadline = time.monotonic() + timeout_s
        for kind in ("startupProbe", "readinessProbe"):
            if kind not in self.container:
                continue
            period = min(float(self.container[kind].get("periodSeconds", 10)), 1.0)
            while not self.probe(kind):
                if not self.running():
                    raise AssertionError(f"{self.name} exited:\n{self.logs()[-4000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.name}: {kind} never passed\n{self.logs()[-4000:]}")
                time.sleep(period)

    def running(self) -> bool:
        out = subprocess.run(
            [self.engine, "inspect", "--format", "{{.State.Running}}", self.name],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        return out == "true"

    def exec(self, *command: str) -> subprocess.CompletedProcess[str]:
        """A command run inside the container (its user, its environment)."""
        return subprocess.run(
            [self.engine, "exec", self.name, *command], capture_output=True, text=True, check=False
        )

    def kill(self) -> None:
        subprocess.run([self.engine, "kill", "--signal", "KILL", self.name], check=True)

    def logs(self) -> str:
        done = subprocess.run(
            [self.engine, "logs", self.name], capture_output=True, text=True, check=False
        )
        return done.stdout + done.stderr

    def remove(self) -> None:
        subprocess.run(
            [self.engine, "rm", "--force", "--time", "0", self.name],
            capture_output=True,
            check=False,
        )


def pods_of(
    manifests: Manifests,
    component: str,
    engine: str,
    network: str,
    prefix: str,
    scratch: Path,
) -> list[Pod]:
    """The pods the workload of `component` runs (its replicas), ready to start: a
    StatefulSet's are `<name>-0`, `<name>-1`... as Kubernetes names them (the workers' ids),
    a Deployment's `<name>-<i>`. `prefix` keeps the container names of one test run apart;
    `scratch` holds the pods' emptyDirs and claims, as a node's disk does."""
    workload = manifests.workload(component)
    name = workload["metadata"]["name"]
    spec = workload["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    service = manifests.service(component)
    replicas = int(workload["spec"].get("replicas", 1))
    claims = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
    pods = []
    for ordinal in range(replicas):
        pod_name = f"{name}-{ordinal}"
        args = [
            "--network",
            network,
            "--network-alias",
            service,
            "--hostname",
            pod_name,
            "--stop-timeout",
            str(spec.get("terminationGracePeriodSeconds", 30)),
            *_security(spec, container),
            *_environment(manifests, container, pod_name),
            *_volumes(spec, container, claims, scratch / pod_name),
        ]
        if "command" in container:
            args += ["--entrypoint", json.dumps(container["command"])]
        args += [container["image"], *container.get("args", [])]
        pods.append(Pod(engine, f"{prefix}{pod_name}", container, spec, args))
    return pods


def _security(spec: dict[str, Any], container: dict[str, Any]) -> list[str]:
    args: list[str] = []
    pod_context = spec.get("securityContext", {})
    context = container.get("securityContext", {})
    user = context.get("runAsUser", pod_context.get("runAsUser"))
    if user is not None:
        args += ["--user", str(user)]
    if context.get("readOnlyRootFilesystem"):
        # only the volumes the manifest mounts are writable (no engine-provided tmpfs)
        args += ["--read-only", "--read-only-tmpfs=false"]
    if context.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    for cap in context.get("capabilities", {}).get("drop", []):
        args += ["--cap-drop", cap]
    return args


def _environment(manifests: Manifests, container: dict[str, Any], pod_name: str) -> list[str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(manifests.config_map(source["configMapRef"]["name"]))
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = item["valueFrom"]
        if "secretKeyRef" in ref:
            secret = ref["secretKeyRef"]
            env[item["name"]] = manifests.secret(secret["name"], secret["key"])
        elif ref.get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = pod_name
        else:
            raise AssertionError(f"an env source not handled: {item}")
    return [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]


def _volumes(
    spec: dict[str, Any], container: dict[str, Any], claims: set[str], scratch: Path
) -> list[str]:
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    args: list[str] = []
    for mount in container.get("volumeMounts", []):
        target = mount["mountPath"]
        volume = volumes.get(mount["name"], {})
        if mount["name"] in claims or "emptyDir" in volume:
            # a fresh claim or an emptyDir: an empty directory of the node's disk that the
            # pod's user may write (what the pod's fsGroup grants in Kubernetes)
            directory = scratch / mount["name"]
            directory.mkdir(parents=True, exist_ok=True)
            directory.chmod(0o1777)
            args += ["--volume", f"{directory}:{target}:rw"]
        elif "hostPath" in volume:
            source = Path(volume["hostPath"]["path"]) / mount.get("subPath", "")
            mode = "ro" if mount.get("readOnly") else "rw"
            args += ["--volume", f"{source}:{target}:{mode}"]
        else:
            raise AssertionError(f"a volume kind not handled: {volume}")
    return args
