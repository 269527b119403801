#!/usr/bin/env bash
# The test command: set up, then run the whole suite against a real Kafka broker and Redis
# (started by the test fixtures, or taken from KAFKA_BOOTSTRAP_SERVERS / REDIS_URL).
# Fails on any test failure and when no test ran (pytest exit 5).
# Two pytest-xdist workers: the unit tests (no services, no timing) on one beside the rest,
# which run on the other in order (tests/conftest.py, pytest_xdist_make_scheduler).
# ROLLSTREAM_TEST_WORKERS=0 runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
python -m pytest -q -n "${ROLLSTREAM_TEST_WORKERS:-2}" "$@" || status=$?
if [ "$status" -ne 0 ]; then
  echo "test.sh: pytest exited with status $status" >&2
  exit "$status"
fi
