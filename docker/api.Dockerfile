# The API pod image: FastAPI + uvicorn, no model code.
# Build from the repository root: docker build -f docker/api.Dockerfile -t duplex-serve-api .
# BASE_IMAGE: the Python 3.11 image both stages start from (docker/worker.Dockerfile's too).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# pip's own settings, for a mirror (unset unless given)
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY plugins ./plugins
RUN pip install --no-cache-dir --prefix=/install .

FROM ${BASE_IMAGE}
# libopus: the pod's Opus encoder for Moshi's protocol (services/api/libopus.py; without it
# the pod falls back to sphn's, at about 5x the CPU for a listening model)
RUN apt-get update \
    && apt-get install -y --no-install-recommends libopus0 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /install /usr/local
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin duplex
USER 10001
EXPOSE 8000
ENTRYPOINT ["duplex"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
