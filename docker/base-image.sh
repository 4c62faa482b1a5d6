#!/bin/sh
# The base image to build ours from, printed: python:3.11-slim from Docker Hub where a
# registry answers, or else the local stand-in (docker/base-standin.sh, built once and kept).
# Progress goes to stderr; stdout is the image's name alone.
#
#   BASE_IMAGE=$(sh docker/base-image.sh podman)
set -eu
ENGINE=${1:?usage: $0 docker|podman}
OFFICIAL=docker.io/library/python:3.11-slim
STANDIN=localhost/python:3.11-slim

if $ENGINE image inspect "$OFFICIAL" >/dev/null 2>&1 \
  || timeout 60 $ENGINE pull -q "$OFFICIAL" >/dev/null 2>&1; then
  echo "$OFFICIAL"
  exit 0
fi
echo "no registry answered for $OFFICIAL: using the stand-in $STANDIN" >&2
sh "$(dirname "$0")/base-standin.sh" "$ENGINE" "$STANDIN" >&2
echo "$STANDIN"
