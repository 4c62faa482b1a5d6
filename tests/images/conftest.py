"""The built images, run as the chart's pods (`make test-images`).

`make test-images` builds the API image, the CPU variants of the cascade worker (the echo
plugin) and the Moshi worker, and a stand-in for the chart's bundled Redis, then runs this
folder. Each release is what `helm template` renders from the values below; its pods are
containers started by tests/images/pods.py with exactly the rendered environment, arguments,
security settings, volumes and probes, on a container network of their own. Every container
and network made here carries the label `io.duplex-serve.test=images` and is removed at the
end, pass or fail (and `make test-images` removes any a killed run left behind).

Not collected by a plain `pytest` or `make test` (pyproject's `norecursedirs`): name the
directory, as `make test-images` does.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.images.pods import ROOT, Manifests, Pod, pods_of

LABEL = "io.duplex-serve.test=images"
#: what `make test-images` built and names (these defaults: podman, the chart's appVersion)
ENGINE = os.environ.get("DUPLEX_IMAGE_ENGINE", "podman")
PREFIX = os.environ.get("DUPLEX_IMAGE_PREFIX", "localhost/")
VERSION = os.environ.get("DUPLEX_IMAGE_VERSION", "0.1.0")
REDIS_IMAGE = os.environ.get("DUPLEX_TEST_REDIS_IMAGE", "localhost/duplex-test-redis:7")
HELM = os.environ.get("DUPLEX_HELM", str(ROOT / ".tools" / "helm"))
MOSHI_PYTHON = os.environ.get("DUPLEX_MOSHI_PYTHON", str(ROOT / ".venv-moshi" / "bin" / "python"))


def release_values(**workers: Any) -> dict[str, Any]:
    """A release of the chart on the images built here: one API pod, the bundled Redis (the
    stand-in image), heartbeats fast enough that a killed worker is noticed in seconds."""
    image = {"repository": "", "tag": f"{VERSION}-cpu"}  # the workers' CPU variants
    return {
        "image": {
            "api": {"repository": f"{PREFIX}duplex-serve-api", "tag": VERSION},
            "pullPolicy": "Never",
            "workers": {
                "cascade": {
                    **image,
                    "repository": f"{PREFIX}duplex-serve-worker-cascade",
                    "plugins": ["echo", "assistant"],
                },
                "moshi": {
                    **image,
                    "repository": f"{PREFIX}duplex-serve-worker-moshi",
                    "plugins": ["moshi"],
                },
                "nemotron": None,
                "minicpmo": None,
            },
        },
        "config": {"heartbeatIntervalSeconds": 0.5, "heartbeatTtlSeconds": 3},
        "api": {"replicas": 1, "autoscaling": {"enabled": False}},
        "redis": {"bundled": True, "image": REDIS_IMAGE},
        "workers": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}, **workers},
    }


@dataclass
class Release:
    """One release's pods, running: `redis`, `api`, `workers` (StatefulSet ordinals)."""

    manifests: Manifests
    redis: Pod
    api: Pod
    workers: list[Pod]
    started: list[Pod] = field(default_factory=list)

    @property
    def api_base(self) -> str:
        return self.api.url("http")

    def redis_url(self) -> str:
        return f"redis://{self.redis.ip}:6379/0"

    def key_prefix(self) -> str:
        name = self.manifests.workload("api")["metadata"]["name"].removesuffix("-api")
        return self.manifests.config_map(f"{name}-config")["DUPLEX_KEY_PREFIX"]


@pytest.fixture(scope="session")
def network() -> Iterator[str]:
    name = f"duplex-images-{uuid.uuid4().hex[:6]}"
    subprocess.run([ENGINE, "network", "create", "--label", LABEL, name], check=True)
    yield name
    subprocess.run([ENGINE, "network", "rm", "--force", name], capture_output=True, check=False)


@pytest.fixture(scope="module")
def start_release(network: str, tmp_path_factory) -> Iterator[Any]:
    """`start_release(name, values)`: render the release, start its Redis, its API pod and
    its workers as the manifests say, wait for each one's probes; removed at the end."""
    started: list[Pod] = []

    def start(release: str, values: dict[str, Any]) -> Release:
        manifests = Manifests.render(HELM, release, values)
        prefix = f"{network}-"

        def run(component: str) -> list[Pod]:
            scratch = tmp_path_factory.mktemp(f"{release}-volumes")
            pods = pods_of(manifests, component, ENGINE, network, prefix, scratch)
            for pod in pods:
                pod.args[:0] = ["--label", LABEL]
                started.append(pod)
                pod.start()
            return pods

        (redis,) = run("redis")
        redis.wait_ready(60)
        (api,) = run("api")
        workers = run("worker")
        for worker in workers:  # the API pod is ready once a worker is live
            worker.wait_ready(300)
        api.wait_ready(120)
        return Release(manifests, redis, api, workers, started)

    yield start
    for pod in reversed(started):
        pod.remove()


@pytest.fixture(scope="module")
def tiny_moshi(tmp_path_factory) -> Path:
    """The tiny random Moshi checkpoint (harness/tiny_moshi.py), made with .venv-moshi's
    torch and moshi, readable by the worker's user (uid 10001) through a read-only mount."""
    if not Path(MOSHI_PYTHON).exists():
        pytest.fail(f"no Moshi venv at {MOSHI_PYTHON}: `make test-images` builds it")
    root = tmp_path_factory.mktemp("tiny-moshi")
    made = subprocess.run(
        [
            MOSHI_PYTHON,
            "-c",
            "import sys; from pathlib import Path; from harness.tiny_moshi import make_tiny_moshi; "
            "make_tiny_moshi(Path(sys.argv[1]))",
            str(root / "checkpoint"),
        ],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if made.returncode != 0:
        pytest.fail(f"the tiny Moshi checkpoint was not made:\n{made.stderr[-4000:]}")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root
