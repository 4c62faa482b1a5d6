"""Rolling restarts and node drains: the worker pods drain within their grace period, roll
one at a time, and a PodDisruptionBudget lets node drains evict one worker at a time."""

import subprocess

from tests.helm.test_chart import CHART, HELM, PRODUCTION, render


def pod_env(pod: dict, config: dict[str, str]) -> dict[str, str]:
    """What the container's process sees: the ConfigMap (envFrom), then its own env over it."""
    env = dict(config)
    env.update({e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e})
    return env


def refused(*sets: str) -> str:
    args = [HELM, "template", "duplex", str(CHART)]
    for item in sets:
        args += ["--set", item]
    result = subprocess.run(args, capture_output=True, text=True)
    assert result.returncode != 0, sets
    return result.stderr


def test_workers_drain_for_their_own_timeout_within_a_derived_grace_period():
    from shared.settings import ApiSettings, WorkerSettings

    def worker_and_api(*sets: str) -> tuple[dict, float, float]:
        docs = render(sets=sets)
        config = docs[("ConfigMap", "duplex-config")]["data"]
        worker = docs[("StatefulSet", "duplex-worker")]["spec"]["template"]["spec"]
        api = docs[("Deployment", "duplex-api")]["spec"]["template"]["spec"]
        return (
            worker,
            WorkerSettings.from_env(pod_env(worker, config)).drain_timeout_s,
            ApiSettings.from_env(pod_env(api, config)).drain_timeout_s,
        )

    worker, drain, api_drain = worker_and_api()
    assert (drain, api_drain) == (20.0, 20.0)
    assert worker["terminationGracePeriodSeconds"] == 20 + 15  # drain + margin
    # each kind drains for its own value: the ConfigMap both mount does not carry it
    worker, drain, api_drain = worker_and_api(
        "workers.drainTimeoutSeconds=45",
        "workers.drainMarginSeconds=30",
        "api.drainTimeoutSeconds=8",
    )
    assert (drain, api_drain) == (45.0, 8.0)
    assert worker["terminationGracePeriodSeconds"] == 75


def test_the_old_grace_value_and_a_drain_timeout_in_extra_env_are_refused_with_a_pointer():
    assert "workers.drainTimeoutSeconds" in refused("workers.terminationGracePeriodSeconds=60")
    stderr = refused(
        "workers.extraEnv[0].name=DUPLEX_DRAIN_TIMEOUT_S", "workers.extraEnv[0].value=5"
    )
    assert "workers.drainTimeoutSeconds" in stderr
    refused("workers.drainMarginSeconds=0")  # the moves after the deadline need time


def test_the_worker_statefulset_rolls_one_pod_at_a_time():
    spec = render(PRODUCTION)[("StatefulSet", "duplex-worker")]["spec"]
    strategy = spec["updateStrategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy.get("rollingUpdate", {}).get("partition", 0) == 0  # every pod is updated
    assert strategy.get("rollingUpdate", {}).get("maxUnavailable", 1) == 1
    # the update waits for each new worker to be ready (model warm, registered) before the next
    readiness = spec["template"]["spec"]["containers"][0]["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/health/ready"


def test_node_drains_evict_one_worker_at_a_time():
    docs = render(PRODUCTION)  # four workers
    budget = docs[("PodDisruptionBudget", "duplex-worker")]["spec"]
    assert budget["maxUnavailable"] == 1 and "minAvailable" not in budget
    assert budget["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    workers = docs[("StatefulSet", "duplex-worker")]["spec"]["template"]["metadata"]["labels"]
    api = docs[("Deployment", "duplex-api")]["spec"]["template"]["metadata"]["labels"]
    selector = budget["selector"]["matchLabels"]
    assert selector.items() <= workers.items() and not selector.items() <= api.items()
    # the API pods keep their own budget
    assert docs[("PodDisruptionBudget", "duplex-api")]["spec"]["minAvailable"] == 1
    wider = render(PRODUCTION, sets=("workers.podDisruptionBudget.maxUnavailable=25%",))
    assert wider[("PodDisruptionBudget", "duplex-worker")]["spec"]["maxUnavailable"] == "25%"
    # one worker: its sessions have nowhere to move, so no budget; or switched off
    assert ("PodDisruptionBudget", "duplex-worker") not in render()
    off = render(PRODUCTION, sets=("workers.podDisruptionBudget.enabled=false",))
    assert ("PodDisruptionBudget", "duplex-worker") not in off
    refused("workers.podDisruptionBudget.maxUnavailable=0")  # would block every node drain
