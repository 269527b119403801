#!/usr/bin/env bash
# The main job: set up, then run the embedded demo (local Kafka + Redis, the whole pipeline
# with a tiny model built offline, and a GRPO trainer), printing the reward increase.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec rollstream demo "$@"
