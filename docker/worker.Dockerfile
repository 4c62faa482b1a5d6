# The worker pod images: the session engine and one kind of model plugin each (docs/deploy.md).
# Build from the repository root (`make images` builds every kind):
#   docker build -f docker/worker.Dockerfile -t duplex-serve-worker-cascade:0.1.0 .
#   docker build -f docker/worker.Dockerfile --build-arg WORKER_KIND=moshi \
#     -t duplex-serve-worker-moshi:0.1.0 .
# Build arguments:
#   WORKER_KIND      cascade (echo, assistant, vLLM; the default), moshi, nemotron or minicpmo:
#                    the plugins an image holds (docker/install-worker.sh says which)
#   TORCH            cuda (the default: GPU nodes) or cpu (PyTorch's +cpu wheels: tests, CPU nodes)
#   BASE_IMAGE       the Python 3.11 image both stages start from (python:3.11-slim)
#   TORCH_SPEC       replaces the kind's torch requirement (e.g. torch==2.9.1)
#   TORCH_CPU_INDEX  where +cpu wheels come from (empty: pip's own settings only)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_CERT: pip's own, for a mirror
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG WORKER_KIND=cascade
ARG TORCH=cuda
ARG TORCH_SPEC=
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# without a default: unset unless given, so pip's own defaults hold
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a venv, copied whole into the final stage at the same path
RUN python -m venv /opt/duplex
ENV PATH=/opt/duplex/bin:$PATH
WORKDIR /src
# the kind's dependencies first, from pyproject.toml alone (its readme a placeholder): this
# layer (torch, the model packages: gigabytes) is rebuilt only when they change, not with every
# change to our code or docs
COPY docker/install-worker.sh /usr/local/bin/
COPY pyproject.toml ./
RUN touch README.md && sh /usr/local/bin/install-worker.sh deps "$WORKER_KIND" "$TORCH" /src
COPY README.md ./
COPY shared ./shared
COPY services ./services
COPY plugins ./plugins
RUN sh /usr/local/bin/install-worker.sh project "$WORKER_KIND" "$TORCH" /src

FROM ${BASE_IMAGE}
ARG WORKER_KIND=cascade
ARG TORCH=cuda
# torch.compile needs a compiler at run time (moshi compiles its gating and rotary functions,
# vLLM its graphs): on a GPU, Triton builds its launchers with a C compiler; on the CPU,
# Inductor writes C++ kernels and builds them with g++ (without one, a CPU worker fails when
# the model first steps: InvalidCxxCompiler).
RUN if [ "$TORCH" = cuda ]; then compiler="gcc libc6-dev"; else compiler="g++"; fi \
    && apt-get update \
    && apt-get install -y --no-install-recommends $compiler \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/duplex /opt/duplex
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin duplex
# Nothing is written outside /tmp at run time (the chart mounts it writable over a read-only
# root): caches of torch, Triton, Hugging Face and vLLM go under HOME. NVIDIA's runtime mounts
# only the driver's utilities unless an image asks for compute.
ENV PATH=/opt/duplex/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL io.duplex-serve.worker-kind="$WORKER_KIND" io.duplex-serve.torch="$TORCH"
USER 10001
EXPOSE 8081
ENTRYPOINT ["duplex"]
CMD ["worker", "--plugin", "echo"]
