#!/bin/sh
# Build flags that give pip inside an image build the settings pip has on this machine: its
# index and extra indexes, its wheel directories and its CA bundle (a mirror, a proxy that
# re-signs TLS, wheels kept on disk). Prints them, for IMAGE_BUILD_FLAGS:
#
#   make images IMAGE_BUILD_FLAGS="--network host $(sh docker/host-pip-flags.sh)"
#
# Each local path (a directory, a file:// index, the CA file) is mounted read-only at the same
# path (a file:// index: its parent folder, where its pages link), and the setting is passed as the build argument of the same name (the Dockerfiles
# declare PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS and PIP_CERT). A setting pip
# does not have prints nothing.
set -eu
PIP=${PIP:-pip}

setting() {  # the environment's PIP_* first, as pip reads it, then pip's config files
  value=$(printenv "$1" || true)
  if [ -z "$value" ]; then
    value=$($PIP config get "global.$2" 2>/dev/null || true)
  fi
  echo "$value"
}

mounts=''
mount_local() {  # $2: "index" mounts a file:// index's parent (its pages link to ../files)
  for item in $1; do
    path=${item#file://}
    if [ "${2:-}" = index ] && [ "$path" != "$item" ]; then
      path=$(dirname "$path")
    fi
    case $path in
      /*) if [ -e "$path" ]; then
            case " $mounts " in *" $path "*) ;; *) mounts="$mounts $path" ;; esac
          fi ;;
    esac
  done
}

flags=''
for pair in PIP_INDEX_URL:index-url PIP_EXTRA_INDEX_URL:extra-index-url \
  PIP_FIND_LINKS:find-links PIP_CERT:cert; do
  name=${pair%%:*} key=${pair#*:}
  value=$(setting "$name" "$key" | tr '\n' ' ' | sed 's/ *$//')
  [ -n "$value" ] || continue
  case $key in *index-url) mount_local "$value" index ;; *) mount_local "$value" ;; esac
  flags="$flags --build-arg $name='$value'"
done
for path in $mounts; do
  flags="$flags -v $path:$path:ro"
done
echo "$flags" | sed 's/^ //'
