"""A worker serving a native full-duplex model (moshi, PersonaPlex) from the chart: its
checkpoint directory on a read-only volume, the plugin options it is started with, a GPU."""

from tests.helm.test_chart import CHART, render
from tests.helm.test_worker_drain import pod_env, refused

MOSHI_VALUES = CHART / "ci" / "moshi-values.yaml"


def worker_pod(*sets: str, values: tuple = ()) -> tuple[dict, dict[str, str]]:
    docs = render(*values, sets=sets)
    pod = docs[("StatefulSet", "duplex-worker")]["spec"]["template"]["spec"]
    return pod, pod_env(pod, docs[("ConfigMap", "duplex-config")]["data"])


def test_a_moshi_worker_reads_its_checkpoint_read_only_with_its_options_on_a_gpu():
    from shared.settings import WorkerSettings

    pod, env = worker_pod(values=(MOSHI_VALUES,))  # the example docs/models.md shows
    container = pod["containers"][0]
    assert container["args"] == ["worker", "--plugin", "moshi"]
    settings = WorkerSettings.from_env(env)
    assert settings.max_sessions == 16  # the model's batch of slots
    assert settings.model_dir == "/models/personaplex-7b-v1"
    options = settings.plugin_options()
    assert options["preset"] == "personaplex"
    assert options["voice_prompt_dir"] == "/models/personaplex-7b-v1/voices"
    mount = {m["name"]: m for m in container["volumeMounts"]}["model"]
    assert mount == {
        "name": "model",
        "mountPath": "/models/personaplex-7b-v1",
        "readOnly": True,
        "subPath": "personaplex-7b-v1",
    }
    volume = {v["name"]: v for v in pod["volumes"]}["model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "duplex-models", "readOnly": True}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_a_node_directory_can_hold_the_model_instead_of_a_claim():
    pod, env = worker_pod(
        "workers.plugin=moshi",
        "workers.modelDir=/models",
        "workers.modelVolume.hostPath=/srv/models",
    )
    assert env["DUPLEX_MODEL_DIR"] == "/models"
    assert "DUPLEX_PLUGIN_OPTIONS" not in env  # no options: none rendered
    volume = {v["name"]: v for v in pod["volumes"]}["model"]
    assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["model"]
    assert (mount["mountPath"], mount["readOnly"], "subPath" in mount) == ("/models", True, False)


def test_workers_without_a_model_get_no_volume_and_no_model_settings():
    pod, env = worker_pod()
    assert not {"DUPLEX_MODEL_DIR", "DUPLEX_PLUGIN_OPTIONS"} & set(env)
    # /tmp only (the one writable place: test_images.py), no model volume
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert [m["name"] for m in pod["containers"][0]["volumeMounts"]] == ["tmp"]


def test_options_render_sorted_and_typed_values_as_text():
    _, env = worker_pod("workers.pluginOptions.slots=4", "workers.pluginOptions.device=cuda")
    assert env["DUPLEX_PLUGIN_OPTIONS"] == "device=cuda,slots=4"


def test_inconsistent_model_values_are_refused_with_a_pointer():
    assert "not both" in refused(
        "workers.modelDir=/m",
        "workers.modelVolume.existingClaim=c",
        "workers.modelVolume.hostPath=/h",
    )
    assert "workers.modelDir" in refused("workers.modelVolume.existingClaim=c")
    assert "workers.modelDir" in refused(
        "workers.extraEnv[0].name=DUPLEX_MODEL_DIR", "workers.extraEnv[0].value=/m"
    )
    assert "workers.pluginOptions" in refused(
        "workers.extraEnv[0].name=DUPLEX_PLUGIN_OPTIONS", "workers.extraEnv[0].value=a=b"
    )
    refused("workers.modelDir=relative/dir")  # mounted at an absolute path
    refused("workers.pluginOptions.voice=a\\,b")  # a comma would split the option
