"""A small cluster of real processes: redis-server, one worker, two API pods."""

import dataclasses
import uuid

import pytest

from harness.processes import HttpProcess, Process, start_api, start_serve, start_worker


@dataclasses.dataclass
class Cluster:
    redis_url: str
    prefix: str
    worker: Process
    apis: list[HttpProcess]

    def extra_api(self, name: str) -> HttpProcess:
        api = start_api(self.redis_url, self.prefix, name)
        api.wait_ready()
        return api


@pytest.fixture(scope="module", params=["redis", "redis-cluster"])
def cluster(request):
    """The same e2e suite on one Redis and on a 3-master Redis Cluster."""
    name = "redis_server" if request.param == "redis" else "redis_cluster"
    backend = request.getfixturevalue(name)
    prefix = f"duplex-test-{uuid.uuid4().hex[:8]}"
    worker = start_worker(backend.url, prefix)
    apis = [start_api(backend.url, prefix, f"api-{i}") for i in range(2)]
    try:
        for api in apis:
            api.wait_ready()
        yield Cluster(backend.url, prefix, worker, apis)
    finally:
        for process in [*apis, worker]:
            process.stop()


@pytest.fixture(scope="module")
def serve():
    """`duplex serve` on its embedded Redis."""
    process = start_serve()
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()
