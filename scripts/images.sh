#!/usr/bin/env bash
# Build every image compose.yaml builds (rollstream, Kafka, Redis, Prometheus, the vLLM CPU
# server) with `docker compose build`, on a local Debian base made here with debootstrap
# (deploy/images/make-base.sh): for machines where no image registry answers. Layers are cached
# by Docker: a second run rebuilds only what changed.
#
#   bash scripts/images.sh                  # base local/debian:bookworm, then every image
#   BASE_IMAGE= bash scripts/images.sh      # each image on its public base instead (pulled:
#                                           # python:3.11-slim, debian:bookworm-slim)
#   BASE_IMAGE=my/debian:12 bash scripts/images.sh   # every image on a base of yours
#   bash scripts/images.sh kafka redis      # only these services' images
#
# torch comes from TORCH_INDEX_URL (default: PyTorch's CPU wheels); when that index does not
# answer, from PyPI (its torch carries CUDA libraries: a bigger image, the same CPU code).
# Needs a running Docker engine, and root with debootstrap for the local base.
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE="${BASE_IMAGE-local/debian:bookworm}"  # set but empty: compose's per-image defaults
if [ -z "$BASE_IMAGE" ]; then
  unset BASE_IMAGE
else
  export BASE_IMAGE
  [ "${BASE_IMAGE%%/*}" != local ] || bash deploy/images/make-base.sh "$BASE_IMAGE"
fi
if [ -z "${TORCH_INDEX_URL:-}" ]; then
  TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
  if ! curl -fsS -m 15 -o /dev/null "$TORCH_INDEX_URL/torch/" 2>/dev/null; then
    echo "images: $TORCH_INDEX_URL does not answer; torch from PyPI" >&2
    TORCH_INDEX_URL=https://pypi.org/simple
  fi
fi
export TORCH_INDEX_URL

if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
profiles=()
# not gpu: its services build nothing of their own (rollout-worker is the rollstream image), and
# docker-compose 1.29 cannot load it (an interpolated GPU `count` stays a string)
for profile in cpu monitoring kafka3; do profiles+=(--profile "$profile"); done
began=$(date +%s)
"${compose[@]}" "${profiles[@]}" build "$@"
# what earlier builds left untagged (an image superseded by a rebuild: gigabytes for rollstream
# and vLLM), ours only (the label); the layers the new images use stay, and so does the cache
docker image prune -f --filter label=org.rollstream.image >/dev/null
echo "images: built in $(( $(date +%s) - began )) s on ${BASE_IMAGE:-the public bases} (torch from $TORCH_INDEX_URL)" >&2
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^(rollstream|local/)' >&2 || true
