#!/usr/bin/env bash
# Run every CPU benchmark in turn (4-8 minutes on 2 cores), writing bench/results/*.json,
# then print the Markdown summary for bench/README.md. bench/gpu.py needs a GPU and a model:
#   python -m bench.gpu --model-path /path/to/model
set -uo pipefail
cd "$(dirname "$0")/.."
date
for name in codec grouping pipeline inprocess latency trainer memory; do
    echo "== bench.$name ($(uptime | sed 's/.*load average/load average/'))"
    /usr/bin/time -f "bench.$name: %e s wall" python -m "bench.$name" "$@"
done
python -m bench.summary
