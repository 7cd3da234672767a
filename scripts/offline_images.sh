#!/usr/bin/env bash
# Build the public base images docker-compose.yml names, from Debian packages alone, for a
# host that can reach a Debian mirror but no image registry:
#   1. debootstrap a Debian bookworm rootfs and `docker import` it (megha-offline/debian:bookworm),
#   2. on it, build a python:3.11-slim stand-in (Debian's python3 is 3.11, a venv on PATH)
#      and a rabbitmq:3-management stand-in (Debian's rabbitmq-server + management plugin),
#   3. tag them with the public names, so `docker compose up` works unchanged.
# An image whose tag already exists is kept (a real pulled image too) unless --force.
#
# Usage: scripts/offline_images.sh [--force]
# Env:   DEBIAN_MIRROR (default: the host apt's Debian mirror), PYTHON_IMAGE, RABBITMQ_IMAGE,
#        OFFLINE_DIR (scratch space, default .offline/ in the repo, gitignored).
set -euo pipefail
cd "$(dirname "$0")/.."

FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "offline_images: unknown argument $arg" >&2; exit 2 ;;
  esac
done

SUITE=bookworm
BASE_IMAGE=megha-offline/debian:$SUITE
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim}
RABBITMQ_IMAGE=${RABBITMQ_IMAGE:-rabbitmq:3-management}
OFFLINE_DIR=${OFFLINE_DIR:-.offline}

log() { printf '== offline_images: %s\n' "$*"; }
have_image() { [ "$FORCE" = 0 ] && docker image inspect "$1" >/dev/null 2>&1; }

# The Debian mirror the host's apt already uses (one-line .list or deb822 .sources files);
# the -security and -updates archives are found alongside.
apt_uris() {
  cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
    | awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }'
  cat /etc/apt/sources.list.d/*.sources 2>/dev/null \
    | awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }'
}
MIRROR=${DEBIAN_MIRROR:-$(apt_uris | grep -E '/debian/?$' | head -n1 || true)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
MIRROR=${MIRROR%/}
SECURITY=${DEBIAN_SECURITY_MIRROR:-$(apt_uris | grep -E '/debian-security/?$' | head -n1 || true)}
SECURITY=${SECURITY:-${MIRROR}-security}
SECURITY=${SECURITY%/}

docker info >/dev/null 2>&1 || { echo "offline_images: no Docker engine answers" >&2; exit 1; }

build_base() {
  if have_image "$BASE_IMAGE"; then
    log "$BASE_IMAGE exists, kept"
    return
  fi
  [ "$(id -u)" = 0 ] || { echo "offline_images: debootstrap needs root" >&2; exit 1; }
  if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
  fi
  local rootfs="$OFFLINE_DIR/rootfs-$SUITE"
  rm -rf "$rootfs"
  mkdir -p "$rootfs"
  log "debootstrap $SUITE from $MIRROR"
  debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$OFFLINE_DIR/debootstrap.log" 2>&1 \
    || { tail -n 30 "$OFFLINE_DIR/debootstrap.log" >&2; exit 1; }
  cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
SOURCES
  # What docker's debian images do: no docs, no caches, no services started by postinst.
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod +x "$rootfs/usr/sbin/policy-rc.d"
  printf 'path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/locale/*\n' \
    >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-minimal"
  printf 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n' \
    >"$rootfs/etc/apt/apt.conf.d/docker-minimal"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
  log "docker import -> $BASE_IMAGE"
  tar -C "$rootfs" --numeric-owner -c . \
    | docker import -c 'CMD ["bash"]' -c 'ENV LANG=C.UTF-8' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
}

# apt inside `docker build` needs the mirror: the host's network reaches it for sure,
# the default bridge may not (no NAT, DNS only on the host).
build_on_base() { # image dockerfile
  local image=$1 dockerfile=$2
  if have_image "$image"; then
    log "$image exists, kept"
    return
  fi
  log "building $image from Debian packages ($dockerfile)"
  DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE=$BASE_IMAGE" \
    -t "$image" -f "$dockerfile" docker/offline >"$OFFLINE_DIR/build-${image//[:\/]/_}.log" 2>&1 \
    || { tail -n 30 "$OFFLINE_DIR/build-${image//[:\/]/_}.log" >&2; exit 1; }
}

mkdir -p "$OFFLINE_DIR"
start=$SECONDS
if have_image "$PYTHON_IMAGE" && have_image "$RABBITMQ_IMAGE"; then
  log "$PYTHON_IMAGE and $RABBITMQ_IMAGE exist, nothing to do (--force rebuilds)"
  exit 0
fi
build_base
build_on_base "$PYTHON_IMAGE" docker/offline/python.Dockerfile
build_on_base "$RABBITMQ_IMAGE" docker/offline/rabbitmq.Dockerfile
log "done in $((SECONDS - start)) s: $PYTHON_IMAGE, $RABBITMQ_IMAGE"
