#!/usr/bin/env bash
# Run every CPU benchmark in turn (4-8 minutes on 2 cores), writing bench/results/*.json,
# then print the Markdown summary for bench/README.md. bench/server.py starts a vLLM server (CPU) or takes a GPU server:
#   python -m bench.server [--server-url URL --model-path DIR]
# A local server gets core 0 to itself (--server-cpus 0, the layout its 95% target is measured on).
set -uo pipefail
cd "$(dirname "$0")/.."
date
server_args=()
if [ "$(nproc)" -gt 1 ] && [[ " $* " != *" --server-url"* ]]; then server_args=(--server-cpus 0); fi
for name in codec grouping pipeline inprocess latency trainer memory server; do
    echo "== bench.$name ($(uptime | sed 's/.*load average/load average/'))"
    args=("$@"); [ "$name" = server ] && args=("${server_args[@]}" "$@")
    /usr/bin/time -f "bench.$name: %e s wall" python -m "bench.$name" "${args[@]}"
done
python -m bench.summary
