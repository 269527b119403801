#!/usr/bin/env bash
# CI's compose check (after the test suite, .ci/run): the streaming deployment of compose.yaml
# built and run on this machine. Installs Docker (Debian's docker.io), debootstrap and
# docker-compose when missing, starts dockerd when no engine answers (and stops it again at the
# end), builds every image from a local Debian base (scripts/images.sh: Docker's layer cache
# makes a second build seconds), then `python -m bench.compose_run`: up, N trainer steps, tiers
# stopped and started, the accounting checked from the topics, down. Any failure fails CI.
#   COMPOSE_CHECK_STEPS (5): trainer steps to wait for.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "compose_check: installing ${missing[*]}" >&2
  $sudo apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

dockerd_pid=""
stop_dockerd() {
  if [ -n "$dockerd_pid" ]; then
    echo "compose_check: stopping the dockerd it started ($dockerd_pid)" >&2
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
  fi
}
trap stop_dockerd EXIT
if ! docker info >/dev/null 2>&1; then
  log="${TMPDIR:-/tmp}/rollstream-dockerd.log"
  echo "compose_check: no Docker engine answers; starting dockerd (log: $log)" >&2
  dockerd --storage-driver=overlay2 >"$log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "compose_check: dockerd did not answer in 60 s:" >&2; tail -20 "$log" >&2; exit 1; }
fi

began=$(date +%s)
bash scripts/images.sh
echo "compose_check: images ready in $(( $(date +%s) - began )) s" >&2
python -m bench.compose_run --steps "${COMPOSE_CHECK_STEPS:-5}" --monitoring --out "${TMPDIR:-/tmp}/rollstream-compose-run.json"
echo "compose_check: passed in $(( $(date +%s) - began )) s" >&2
