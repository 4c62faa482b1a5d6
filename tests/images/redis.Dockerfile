# A stand-in for the chart's bundled Redis image (redis.image, redis:7.2-alpine), built from
# the same base as our images, for `make test-images` on machines that reach no registry:
# Debian's redis-server, started the way the official image starts it (arguments that begin
# with "--" go to redis-server; protected mode off: the pod network is its boundary).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data && chown 999:999 /data
WORKDIR /data
USER 999
EXPOSE 6379
ENTRYPOINT ["redis-server", "--protected-mode", "no"]
