"""What matters in the rendered chart (rendered by the helm binary `make test` fetches)."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "duplex"
PRODUCTION = CHART / "ci" / "production-values.yaml"
HELM = os.environ.get("DUPLEX_HELM", str(ROOT / ".tools" / "helm"))


def render(*values: Path, sets: tuple[str, ...] = ()) -> dict[tuple[str, str], dict]:
    if not Path(HELM).exists():
        pytest.fail(f"helm is missing at {HELM}: run `make test` (it fetches helm into .tools/)")
    args = [HELM, "template", "duplex", str(CHART)]
    for path in values:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def api_routes() -> set[str]:
    from services.api.app import create_app
    from shared.settings import ApiSettings

    return {route.path for route in create_app(ApiSettings()).routes}


def test_hpa_targets_the_api_deployment_and_scales_on_cpu_and_sessions():
    docs = render(PRODUCTION)
    hpa = docs[("HorizontalPodAutoscaler", "duplex-api")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "duplex-api")
    assert ("Deployment", "duplex-api") in docs
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    assert metrics["Pods"]["pods"]["metric"]["name"] == "duplex_active_websocket_sessions"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 30)
    assert "replicas" not in docs[("Deployment", "duplex-api")]["spec"]  # the HPA owns it
    fixed = render(sets=("api.autoscaling.enabled=false", "api.replicas=3"))
    assert ("HorizontalPodAutoscaler", "duplex-api") not in fixed
    assert fixed[("Deployment", "duplex-api")]["spec"]["replicas"] == 3


def test_api_probes_point_at_real_routes_and_the_drain_fits_the_grace_period():
    docs = render()
    pod = docs[("Deployment", "duplex-api")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    routes = api_routes()
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/health" in routes
    drain = int({e["name"]: e for e in container["env"]}["DUPLEX_DRAIN_TIMEOUT_S"]["value"])
    assert pod["terminationGracePeriodSeconds"] > drain
    assert container["args"][0] == "api"


def test_workers_are_a_statefulset_with_gpus_stable_ids_and_warm_readiness():
    docs = render(PRODUCTION)
    statefulset = docs[("StatefulSet", "duplex-worker")]
    assert statefulset["spec"]["replicas"] == 4
    pod = statefulset["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    env = {e["name"]: e for e in container["env"]}
    assert env["DUPLEX_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert container["args"] == ["worker", "--plugin", "echo"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health/ready", "port": "health"}
    assert ("StatefulSet", "duplex-redis") not in docs  # external Redis
    cpu_only = render()[("StatefulSet", "duplex-worker")]["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert "nvidia.com/gpu" not in cpu_only["resources"]["requests"]


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://redis-cluster.data.svc:6379",
        "redis+sentinel://:pw@s1.data.svc:26379,s2.data.svc:26379/duplex/0",
    ],
)
def test_secrets_stay_out_of_configmaps(url, tmp_path):
    values = tmp_path / "redis.yaml"
    values.write_text(yaml.safe_dump({"redis": {"url": url}}))  # a list of sentinels has commas
    docs = render(PRODUCTION, values)
    configmaps = [doc for (kind, _), doc in docs.items() if kind == "ConfigMap"]
    assert configmaps
    for configmap in configmaps:
        assert not {"DUPLEX_REDIS_URL", "DUPLEX_API_KEYS"} & set(configmap["data"])
        for value in configmap["data"].values():
            assert (
                "redis://" not in value
                and "redis+cluster://" not in value
                and "redis+sentinel://" not in value
                and "sk-prod" not in value
            )
    assert docs[("Secret", "duplex-redis")]["stringData"]["redisUrl"] == url
    assert docs[("Secret", "duplex-api-keys")]["stringData"]["apiKeys"] == "sk-prod-example"
    env = {
        e["name"]: e
        for e in docs[("Deployment", "duplex-api")]["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
    }
    assert env["DUPLEX_REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "duplex-redis"
    assert env["DUPLEX_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "duplex-api-keys"


def test_bundled_redis_for_development_and_a_websocket_friendly_ingress():
    docs = render()
    assert ("StatefulSet", "duplex-redis") in docs
    assert (
        docs[("Secret", "duplex-redis")]["stringData"]["redisUrl"] == "redis://duplex-redis:6379/0"
    )
    claim = docs[("StatefulSet", "duplex-redis")]["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    ingress = render(PRODUCTION)[("Ingress", "duplex-api")]
    assert (
        int(ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-read-timeout"])
        >= 3600
    )


def test_schema_refuses_unknown_and_wrong_values():
    for bad in ("workers.gpus=-1", "api.unknownKnob=1", "redis.bundled=maybe"):
        result = subprocess.run(
            [HELM, "template", "duplex", str(CHART), "--set", bad], capture_output=True, text=True
        )
        assert result.returncode != 0, bad
    missing = subprocess.run(
        [HELM, "template", "duplex", str(CHART), "--set", "redis.bundled=false"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode != 0 and "redis.url" in missing.stderr


def test_dockerfiles_copy_what_exists_and_run_the_console_script():
    script = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "duplex" in script
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for name in ("api.Dockerfile", "worker.Dockerfile"):
        text = (ROOT / "docker" / name).read_text()
        for source in re.findall(r"^COPY (?!--from)(\S+)", text, flags=re.M):
            assert (ROOT / source).exists(), f"{name} copies a missing {source}"
        assert re.search(r"^USER 10001$", text, flags=re.M)  # non-root
        assert 'ENTRYPOINT ["duplex"]' in text
        assert text.count("FROM ") == 2  # multi-stage: pip's work stays in the build stage
    # the worker kinds install extras that exist (what else they install: test_images.py)
    install = (ROOT / "docker" / "install-worker.sh").read_text()
    named = re.findall(r'"\$src\[([^\]]+)\]"', install)
    assert {"vllm,assistant", "assistant", "minicpmo-gpu"} <= set(named)
    assert {extra for group in named for extra in group.split(",")} <= set(extras)
    assert "vllm" not in (ROOT / "docker" / "api.Dockerfile").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "tests"} <= set(ignored)


def test_optional_service_monitor_scrapes_metrics():
    assert ("ServiceMonitor", "duplex-api") not in render()
    monitor = render(sets=("serviceMonitor.enabled=true",))[("ServiceMonitor", "duplex-api")]
    endpoint = monitor["spec"]["endpoints"][0]
    assert endpoint["path"] == "/metrics" in api_routes() and endpoint["port"] == "http"


def test_http_limits_reach_the_api_pods_as_the_settings_they_name():
    from shared.settings import ApiSettings, WorkerSettings

    docs = render(PRODUCTION)
    config = docs[("ConfigMap", "duplex-config")]["data"]
    settings = ApiSettings.from_env(config)
    assert (
        settings.chat_max_body_bytes,
        settings.header_timeout_s,
        settings.keep_alive_s,
        settings.limit_concurrency,
        settings.loop_lag_warn_s,
        settings.append_linger_ms,
        settings.admission_wait_s,
        settings.model_ready_timeout_s,
    ) == (1048576, 10.0, 5.0, 1000, 0.1, 10.0, 10.0, 120.0)
    assert settings.allowed_origins == frozenset({"https://app.example.com"})
    assert WorkerSettings.from_env(config).loop_lag_warn_s == 0.1
    assert ApiSettings.from_env(
        render()[("ConfigMap", "duplex-config")]["data"]
    ).allowed_origins == (frozenset())
    bad = subprocess.run(
        [HELM, "template", "duplex", str(CHART), "--set", "api.allowedOrigins={evil.example}"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0  # an Origin is scheme://host[:port]


def test_the_ingress_limits_bodies_and_optionally_each_client_ip():
    nginx = "nginx.ingress.kubernetes.io/"
    production = render(PRODUCTION)[("Ingress", "duplex-api")]["metadata"]["annotations"]
    assert production[nginx + "proxy-body-size"] == "1048576"  # = api.limits.chatMaxBodyBytes
    assert (production[nginx + "limit-connections"], production[nginx + "limit-rps"]) == (
        "20",
        "10",
    )
    plain = render(sets=("api.ingress.enabled=true",))[("Ingress", "duplex-api")]
    annotations = plain["metadata"]["annotations"]
    assert not [name for name in annotations if name.startswith(nginx + "limit-")]  # off
    assert int(annotations[nginx + "proxy-read-timeout"]) >= 3600
    mine = render(
        sets=(
            "api.ingress.enabled=true",
            "api.ingress.annotations.nginx\\.ingress\\.kubernetes\\.io/proxy-body-size=4m",
        )
    )[("Ingress", "duplex-api")]["metadata"]["annotations"]
    assert mine[nginx + "proxy-body-size"] == "4m"  # an explicit annotation wins


def test_the_workers_metrics_are_scraped_on_their_health_port():
    docs = render(sets=("serviceMonitor.enabled=true",))
    endpoint = docs[("ServiceMonitor", "duplex-worker")]["spec"]["endpoints"][0]
    assert (endpoint["port"], endpoint["path"]) == ("health", "/metrics")
    service = docs[("Service", "duplex-worker")]
    assert [p["name"] for p in service["spec"]["ports"]] == ["health"]


def test_pods_and_workers_read_one_session_policy_from_the_config_map():
    from shared.settings import ApiSettings, SessionPolicy, WorkerSettings

    config = render(PRODUCTION)[("ConfigMap", "duplex-config")]["data"]
    api, worker = ApiSettings.from_env(config), WorkerSettings.from_env(config)
    assert api.session == worker.session == SessionPolicy()  # the chart's defaults are ours
    tuned = render(
        sets=("config.idleTtlSeconds=60", "config.maxPendingInputBytesPerSession=4194304")
    )[("ConfigMap", "duplex-config")]["data"]
    policy = WorkerSettings.from_env(tuned).session
    assert (policy.idle_ttl_s, policy.max_pending_input_bytes_per_session) == (60.0, 4194304)
    assert ApiSettings.from_env(tuned).session == policy


def test_the_log_level_reaches_every_process_and_a_wrong_one_is_refused():
    from shared.settings import log_level_from_env

    config = render()[("ConfigMap", "duplex-config")]["data"]
    assert log_level_from_env(config) == "INFO"
    quiet = render(sets=("config.logLevel=warning",))[("ConfigMap", "duplex-config")]["data"]
    assert log_level_from_env(quiet) == "WARNING"
    with pytest.raises(subprocess.CalledProcessError) as refused:
        render(sets=("config.logLevel=loud",))
    assert "logLevel" in refused.value.stderr
