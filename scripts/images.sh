#!/usr/bin/env bash
# make images: build the three images (data, train-gpu, serve) from images/ and the lock, tagged with the git sha.
#
#   REGISTRY=ghcr.io/diffusion-gr2 TAG=<git sha> FIND_LINKS=/opt/wheels scripts/images.sh [data train-gpu serve]
#   IMAGES_REPORT=benchmarks/images.md ...   # also write each image's build time and size there
#
# docker where a daemon answers, else podman (installed and configured by scripts/setup-system.sh containers).
# What this machine lacks is made up for with build arguments, never with other Dockerfiles:
# - base: python:3.11.7-slim when it can be pulled, else the local Debian 12 stand-in (scripts/base-image.sh);
# - the machine's CA bundle, mounted for the build only and named to pip (PIP_CERT), for a TLS-inspecting proxy;
# - torch: where PyTorch's index cannot be reached, the lock's CPU wheel from FIND_LINKS (mounted, PIP_FIND_LINKS);
#   the GPU image then gets that CPU torch too, with its CUDA assertion relaxed (REQUIRE_CUDA=0), and says so
#   (REQUIRE_CUDA=1 in the environment keeps the assertion: tests/containers checks that it fires).
set -euo pipefail
cd "$(dirname "$0")/.."
REGISTRY=${REGISTRY:-ghcr.io/diffusion-gr2}
TAG=${TAG:-$(git rev-parse --short HEAD)}
FIND_LINKS=${FIND_LINKS:-/opt/wheels}
PYTHON_BASE=python:3.11.7-slim  # the Dockerfiles' default BASE_IMAGE
roles=("$@")
load0=$(cut -d" " -f1-3 /proc/loadavg)
[ ${#roles[@]} -gt 0 ] || roles=(data train-gpu serve)

if [ -z "${ENGINE:-}" ]; then
  # a Docker daemon, not podman's Docker-compatible service (which names itself "Podman Engine")
  server=$(docker version --format '{{range .Server.Components}}{{.Name}} {{end}}' 2>/dev/null || true)
  if [ -n "$server" ] && [[ $server != *Podman* ]]; then ENGINE=docker; else ENGINE=podman; fi
fi
[ "$ENGINE" = docker ] || scripts/setup-system.sh containers

args=()
if [ -z "${BASE_IMAGE:-}" ]; then
  if "$ENGINE" image inspect "$PYTHON_BASE" >/dev/null 2>&1 || timeout 120 "$ENGINE" pull -q "$PYTHON_BASE" >/dev/null 2>&1; then
    BASE_IMAGE=$PYTHON_BASE
  else
    echo "images: $PYTHON_BASE cannot be pulled here; using the local Debian 12 base (scripts/base-image.sh)"
    t0=$(date +%s)
    BASE_IMAGE=$(scripts/base-image.sh "$ENGINE")
    base_secs=$(($(date +%s) - t0))
  fi
fi
args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
# The commit the images hold, as gr2.report.git_sha writes it (-dirty when tracked files differ from it); GR2_GIT_SHA
# names another (tests/containers checks that a rebuild with a new one holds it).
sha=${GR2_GIT_SHA:-}
if [ -z "$sha" ]; then
  sha=$(git rev-parse HEAD)
  git diff --quiet HEAD -- || sha="$sha-dirty"
fi
args+=(--build-arg "GR2_GIT_SHA=$sha")

relax_cuda=0
if [ "$ENGINE" = podman ]; then  # (docker build has no --volume; a docker host reaches its indexes directly)
  ca=/etc/ssl/certs/ca-certificates.crt
  [ -f "$ca" ] && args+=(--volume "$ca:/run/gr2-ca.crt:ro" --build-arg PIP_CERT=/run/gr2-ca.crt)
  if ! python3 -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/", timeout=15)' 2>/dev/null; then
    torch=$(sed -n 's/^torch==\([^ ]*\).*/\1/p' requirements/lock.txt)
    compgen -G "$FIND_LINKS/torch-${torch}-*.whl" >/dev/null || {
      echo "images: PyTorch's index is unreachable and $FIND_LINKS has no torch $torch wheel" >&2
      exit 1
    }
    echo "images: PyTorch's index is unreachable; torch $torch from $FIND_LINKS, PyPI for the rest"
    args+=(--volume "$FIND_LINKS:/run/gr2-wheels:ro" --build-arg PIP_FIND_LINKS=/run/gr2-wheels
      --build-arg TORCH_INDEX=https://pypi.org/simple)
    relax_cuda=1
  fi
fi

declare -A name=([data]=gr2 [train-gpu]=gr2-train-gpu [serve]=gr2-serve)
rows=()
for role in "${roles[@]}"; do
  [ -n "${name[$role]:-}" ] || { echo "images: unknown image '$role' (data, train-gpu, serve)" >&2; exit 2; }
  ref="$REGISTRY/${name[$role]}:$TAG"
  extra=()
  if [ "$role" = train-gpu ] && [ "$relax_cuda" = 1 ] && [ "${REQUIRE_CUDA:-}" != 1 ]; then
    echo "images: $ref gets the CPU torch (REQUIRE_CUDA=0): it runs the training steps here, not on GPU nodes"
    extra=(--build-arg REQUIRE_CUDA=0)
  fi
  t0=$(date +%s)
  "$ENGINE" build -f "images/Dockerfile.$role" -t "$ref" "${args[@]}" "${extra[@]}" .
  secs=$(($(date +%s) - t0))
  bytes=$("$ENGINE" image inspect --format '{{.Size}}' "$ref")
  echo "images: $ref built in ${secs} s, $((bytes / 1000000)) MB"
  rows+=("| $role | \`$ref\` | $secs | $(python3 -c "print(f'{$bytes / 1e9:.2f}')") |")
done

if [ -n "${IMAGES_REPORT:-}" ]; then  # one section per run, appended
  {
    [ -s "$IMAGES_REPORT" ] || printf '# Image builds\n\nOne section per `make images` run (scripts/images.sh): each image'"'"'s build wall time and its size as the engine\nreports it (uncompressed).\n'
    echo
    echo "## \`${IMAGES_COMMAND:-scripts/images.sh}\` at $(git rev-parse --short HEAD), $(date -u '+%Y-%m-%d %H:%M') UTC"
    echo
    echo "$ENGINE $("$ENGINE" version --format '{{.Client.Version}}' 2>/dev/null); base \`$BASE_IMAGE\`${base_secs:+ (scripts/base-image.sh: $base_secs s)}."
    echo "Machine: $(nproc) cores ($(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)), load average at the start: $load0."
    echo
    echo "| image | reference | build s | size GB |"
    echo "|---|---|---|---|"
    printf '%s\n' "${rows[@]}"
  } >>"$IMAGES_REPORT"
fi
