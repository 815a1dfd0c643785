#!/usr/bin/env bash
# The local stand-in for python:3.11-slim, for machines that reach Debian's mirror and PyPI but no container
# registry (make images). Prints the image's name; builds it only when it is not there yet.
#
#   scripts/base-image.sh [podman|docker]
#
# A Debian 12 root filesystem from debootstrap (Python 3.11 from Debian's packages), made an image with
# `import`. Like python:3.11-slim it has `python` and `pip` on PATH and allows installs: they go to a venv
# (/opt/python, first on PATH; pip, setuptools and wheel in it), so Debian's PEP 668 marker and its own
# python3-* packages stay out of the way.
# The mirror is the machine's own apt source, read at run time. The tag carries a hash of this file, so a
# change here builds a new base and an unchanged one is reused (the cache between builds is the image store).
set -euo pipefail
engine=${1:-podman}
suite=bookworm
tag="localhost/gr2-base:$suite-$(sha256sum "$0" | cut -c1-12)"
if "$engine" image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi

# deb822 sources (Debian 12's default) first, then the one-line format
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || { echo "base-image: no Debian mirror in /etc/apt/sources.list{,.d}" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "base-image: needs debootstrap (scripts/setup-system.sh containers)" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "base-image: debootstrap needs root" >&2; exit 1; }

root=$(mktemp -d /var/tmp/gr2-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base-image: debootstrap $suite from $mirror" >&2
debootstrap --variant=minbase --include=python3,python3-venv,python3-wheel-whl,ca-certificates "$suite" "$root" "$mirror" >&2
chroot "$root" python3 -m venv /opt/python
# wheel too, as python:3.11-slim has it (sdists such as kfp-server-api are built into wheels, not setup.py-installed)
chroot "$root" sh -c '/opt/python/bin/pip install --quiet --no-index /usr/share/python-wheels/wheel-*.whl'
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*
tar -C "$root" -c . | "$engine" import \
  --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$tag" >&2
echo "$tag"
