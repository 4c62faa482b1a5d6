#!/bin/sh
# A stand-in for the python:3.11-slim base image, for machines that reach Debian's archive and
# PyPI but no image registry (the images' build and their test, `make test-images`).
#
#   docker/base-standin.sh ENGINE [TAG]     ENGINE: docker or podman; TAG: localhost/python:3.11-slim
#
# It is Debian bookworm's minimal root filesystem (debootstrap --variant=minbase) with its
# Python 3.11, venv, headers (the official image has them: torch's Inductor compiles against
# Python.h at run time) and CA certificates, and a venv rooted at /usr/local, so `python` and `pip`
# are on PATH where python:3.11-slim puts them and `pip install --prefix=/install`, copied to
# /usr/local, is importable. Nothing else of the official image is relied on. Kept while the
# tag exists: a second run does nothing (delete the image to rebuild it).
set -eu

ENGINE=${1:?usage: $0 docker|podman [TAG]}
TAG=${2:-localhost/python:3.11-slim}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if $ENGINE image inspect "$TAG" >/dev/null 2>&1; then
  echo "base stand-in $TAG: present"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is needed (apt-get install debootstrap)" >&2; exit 1; }

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base stand-in $TAG: debootstrap bookworm (about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
  bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
chroot "$root" python3 -m venv /usr/local
# what an image does not need: the package lists and caches (apt-get update refreshes them)
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | $ENGINE import \
  --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "base stand-in $TAG: built"
