#!/usr/bin/env bash
# The GPU check of an offline bundle (scripts/bundle.sh) on a machine with only Python and torch:
# joins and verifies the parts, installs the wheels into a fresh venv that sees the machine's
# torch, points rollstream at the bundled Java, Kafka jars and redis-server, and runs on --device:
#   1. the HF engine generating (every generated token tagged with the engine's weight version),
#   2. the example trainer's GRPO steps (scripts/check_trainer_gpu.py),
#   3. `rollstream demo --device D` (the whole pipeline, local Kafka + Redis, GRPO trainer),
#   4. `python -m bench.server --engine hf --device D --quick --prompts 16` (pipeline vs direct tokens/s),
# then prints one summary block. Exits 1 when a check failed, 2 on bad arguments or bundle.
#
#   bash gpu_check.sh BUNDLE_DIR [--device cuda|cpu] [--quick] [--work DIR] [--install-only] [--budget S]
#
# BUNDLE_DIR holds rollstream-bundle.tar.gz.part-* and MANIFEST.sha256. --work: where the
# bundle is unpacked and the venv made (default BUNDLE_DIR/gpu-check, emptied first).
# PYTHON: the interpreter with torch (default python3). --quick: a 10-step demo (default 30).
# --install-only: stop after the install and one start of the bundled broker and redis-server.
# --budget: seconds for everything (default 480, 8 minutes); each check gets what is left.
set -euo pipefail

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
say() { echo "gpu_check.sh: $*" >&2; }
usage() { sed -n '11,17p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

BUNDLE="" DEVICE="cuda" QUICK=0 INSTALL_ONLY=0 WORK="" BUDGET=480
while [ $# -gt 0 ]; do
  case "$1" in
    --device) [ $# -ge 2 ] || die "--device needs cuda, cuda:N or cpu"; DEVICE="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    --budget) [ $# -ge 2 ] || die "--budget needs seconds"; BUDGET="$2"; shift 2 ;;
    --work) [ $# -ge 2 ] || die "--work needs a directory"; WORK="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) die "unknown option $1" ;;
    *) [ -z "$BUNDLE" ] || die "one BUNDLE_DIR only (got $BUNDLE and $1)"; BUNDLE="$1"; shift ;;
  esac
done
[ -n "$BUNDLE" ] || usage
[[ "$DEVICE" =~ ^(cpu|cuda(:[0-9]+)?)$ ]] || die "--device $DEVICE: want cpu, cuda or cuda:N"
[[ "$BUDGET" =~ ^[0-9]+$ ]] || die "--budget $BUDGET: want whole seconds"
[ -d "$BUNDLE" ] || die "$BUNDLE is not a directory"
BUNDLE="$(cd "$BUNDLE" && pwd)"
[ -f "$BUNDLE/MANIFEST.sha256" ] || die "no MANIFEST.sha256 in $BUNDLE (made by scripts/bundle.sh OUT_DIR)"
WORK="${WORK:-$BUNDLE/gpu-check}"
PY="${PYTHON:-python3}"
DEMO_STEPS=$([ "$QUICK" = 1 ] && echo 10 || echo 30)
began=$SECONDS

command -v "$PY" >/dev/null || die "$PY not found (set PYTHON to the interpreter that has torch)"
TORCH_INFO="$("$PY" - "$DEVICE" <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("torch is not importable: this check uses the machine's own torch")
device = sys.argv[1]
if device.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit(f"--device {device}: CUDA is not available (torch {torch.__version__}, cuda build {torch.version.cuda})")
    name = torch.cuda.get_device_name(torch.device(device))
else:
    name = "CPU"
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), {name}, Python {sys.version.split()[0]}")
PY
)" || die "the machine's Python cannot run the check (above)"
say "$TORCH_INFO"

# --- 1. verify, join, unpack ----------------------------------------------------------------
say "verifying the parts against MANIFEST.sha256"
mapfile -t PARTS < <(awk '$2 ~ /\.part-/ {print $2}' "$BUNDLE/MANIFEST.sha256")
[ ${#PARTS[@]} -gt 0 ] || die "MANIFEST.sha256 lists no part"
for part in "${PARTS[@]}"; do [ -f "$BUNDLE/$part" ] || die "part $part is missing from $BUNDLE"; done
(cd "$BUNDLE" && grep '\.part-' MANIFEST.sha256 | sha256sum -c --quiet -) || die "a part does not match its sha256 (copy it again)"
rm -rf "$WORK"
mkdir -p "$WORK/logs"
WORK="$(cd "$WORK" && pwd)"
(cd "$BUNDLE" && cat "${PARTS[@]}") > "$WORK/rollstream-bundle.tar.gz"
want="$(awk '$2 == "rollstream-bundle.tar.gz" {print $1}' "$BUNDLE/MANIFEST.sha256")"
got="$(sha256sum "$WORK/rollstream-bundle.tar.gz" | cut -d' ' -f1)"
[ -n "$want" ] && [ "$want" = "$got" ] || die "the joined tar's sha256 $got is not the manifest's ${want:-(none)}"
tar -C "$WORK" -xzf "$WORK/rollstream-bundle.tar.gz"
rm -f "$WORK/rollstream-bundle.tar.gz"
B="$WORK/rollstream-bundle"
say "joined ${#PARTS[@]} parts (sha256 ok), unpacked into $B"
sed 's/^/  /' "$B/BUNDLE_INFO" >&2

# --- 2. venv with the machine's torch -------------------------------------------------------
cd "$WORK"  # not a checkout: nothing imports from the current directory
say "installing the wheels into $WORK/venv (--system-site-packages, --no-index)"
V="$WORK/venv/bin/python"
if ! "$PY" -m venv --system-site-packages "$WORK/venv" > "$WORK/logs/venv.log" 2>&1; then
  # no ensurepip (Debian without python3-venv): a venv without pip, pip run from the bundled wheel
  say "venv with pip failed ($(tail -1 "$WORK/logs/venv.log")); making it --without-pip, pip from the bundle"
  rm -rf "$WORK/venv"
  "$PY" -m venv --system-site-packages --without-pip "$WORK/venv" || die "python -m venv failed (above)"
  pip_wheel="$(ls "$B"/wheels/pip-*.whl 2>/dev/null | head -1)"
  [ -n "$pip_wheel" ] || die "no pip wheel in the bundle to bootstrap the venv with"
  "$V" "$pip_wheel/pip" install -q --no-index --no-deps "$pip_wheel" || die "installing pip from $pip_wheel failed"
fi
if ! "$V" -m pip install -q --disable-pip-version-check --no-index --find-links "$B/wheels" --no-deps \
      --ignore-installed -r "$B/wheels/requirements.txt" "$B"/wheels/rollstream-*.whl > "$WORK/logs/pip.log" 2>&1; then
  tail -20 "$WORK/logs/pip.log" >&2
  die "pip install from the bundle failed (above; the wheels are for $(sed -n 's/^python: //p' "$B/BUNDLE_INFO"))"
fi
# The venv's rollstream is the bundle's wheel: an editable rollstream of the machine's own
# site-packages (a development machine: its import finder would come first) is dropped from it.
site="$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$site/sitecustomize.py" <<'PY'
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___rollstream")]
for name in [m for m in sys.modules if m == "rollstream" or m.startswith("rollstream.")]:
    del sys.modules[name]
PY
# requirements nobody in the bundle meets (torch's own come from the machine)
"$V" -m pip check > "$WORK/logs/pip-check.log" 2>&1 || true
names="$(sed -E 's/==.*//; s/[-_.]/[-_.]/g' "$B/wheels/requirements.txt" | paste -sd'|')"
if grep -iE "^(rollstream|$names) " "$WORK/logs/pip-check.log" >&2; then
  die "installed packages miss a requirement (above; pip check: $WORK/logs/pip-check.log)"
fi
INSTALLED="$("$V" - "$WORK/venv" <<'PY'
import importlib.metadata as m, sys
import aiokafka, msgspec, pyarrow, redis, rollstream, tokenizers, torch, transformers  # noqa: F401
import importlib, pkgutil
if not rollstream.__file__.startswith(sys.argv[1]):
    sys.exit(f"rollstream imports from {rollstream.__file__}, not the venv")
# every module of the installed wheel (a package left out of the wheel fails here, not in the demo)
modules = [mod.name for mod in pkgutil.walk_packages(rollstream.__path__, "rollstream.")]
failed = []
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - every failure is listed below
        failed.append(f"{name}: {type(e).__name__}: {e}")
if failed:
    sys.exit("installed modules that do not import:\n  " + "\n  ".join(failed))
print(f"rollstream {m.version('rollstream')} ({len(modules)} modules import), "
      f"transformers {m.version('transformers')}, torch {torch.__version__}")
PY
)" || die "the installed packages do not import (above)"
"$WORK/venv/bin/rollstream" --help > "$WORK/logs/cli-help.log" 2>&1 \
  || { tail -20 "$WORK/logs/cli-help.log" >&2; die "the installed rollstream command does not start (above)"; }
WHEELS="$(ls "$B"/wheels/*.whl | wc -l)"
say "installed $WHEELS wheels: $INSTALLED"

# --- 3. the bundled services ----------------------------------------------------------------
export JAVA_HOME="$B/jre"
export PATH="$WORK/venv/bin:$B/redis/bin:$PATH"
export ROLLSTREAM_CACHE_DIR="$B/cache"
export ROLLSTREAM_DEV_SERVICES=local
unset KAFKA_BOOTSTRAP_SERVERS REDIS_URL PYTHONPATH VIRTUAL_ENV
SERVICES="$("$V" - "$B" <<'PY'
import sys
from rollstream.dev.kafka_jars import ensure_kafka_jars, java_executable
from rollstream.dev.redis_server import redis_server_executable
found = {"java": java_executable(), "kafka jars": str(ensure_kafka_jars()), "redis-server": redis_server_executable()}
outside = [f"{k} {v}" for k, v in found.items() if not v.startswith(sys.argv[1])]
if outside:
    sys.exit(f"not the bundle's: {outside}")
print(", ".join(f"{k} {v[len(sys.argv[1]) + 1:]}" for k, v in found.items()))
PY
)" || die "rollstream does not find the bundled Java, Kafka jars and redis-server (above)"
say "services from the bundle: $SERVICES"
# the local broker on the jlinked Java and redis-server with its bundled libraries, started once
STARTED="$("$V" - "$WORK/services" 2>"$WORK/logs/services.log" <<'PY'
import sys, time
from pathlib import Path
from rollstream.dev.launcher import dev_stack
began = time.monotonic()
with dev_stack(Path(sys.argv[1])) as dev:
    print(f"Kafka {dev.services.kafka_bootstrap} and Redis {dev.services.redis_url} up in {time.monotonic() - began:.1f}s")
PY
)" || { tail -30 "$WORK/logs/services.log" >&2; die "the bundled broker or redis-server did not start (above; logs under $WORK/services)"; }
say "$STARTED"
if [ "$INSTALL_ONLY" = 1 ]; then
  echo "gpu_check.sh: --install-only: ${#PARTS[@]} parts verified, $(ls "$B"/wheels/*.whl | wc -l) wheels installed ($INSTALLED); $STARTED; services: $SERVICES"
  exit 0
fi
cd "$B/src"  # bench/, harness/ and examples/ (the demo's trainer) are found from here

declare -A RESULT
FAILED=0
step() {  # step NAME TIMEOUT_S CMD...: run, log, record PASS/FAIL
  local name="$1" limit="$2" t0=$SECONDS rc=0 left=$((BUDGET - (SECONDS - began)))
  shift 2
  if [ "$left" -lt 10 ]; then
    say "[$name] FAILED: no time left of --budget ${BUDGET}s"
    RESULT[$name]="FAIL  not run: --budget ${BUDGET}s spent"
    FAILED=1
    return 1
  fi
  [ "$left" -ge "$limit" ] || limit=$left
  say "[$name] $* (at most ${limit}s; log $WORK/logs/$name.log)"
  timeout --kill-after=20 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    tail -25 "$WORK/logs/$name.log" >&2
    [ "$rc" -eq 124 ] && say "[$name] FAILED: timed out after ${limit}s" || say "[$name] FAILED: exit $rc"
    RESULT[$name]="FAIL  exit $rc after $((SECONDS - t0))s (log $WORK/logs/$name.log)"
    FAILED=1
    return 1
  fi
  say "[$name] done in $((SECONDS - t0))s"
  RESULT[$name]="$((SECONDS - t0))"
}

# 1. the HF engine on the device: tokens, their version tags, tokens/s
cat > "$WORK/hf_engine_check.py" <<'PY'
import asyncio, sys, time
from harness.services import tokenizer_path
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.engines.hf import HFEngine

async def main(device: str) -> None:
    path = str(tokenizer_path())
    engine = HFEngine(path, device=device, seed=0)
    await engine.start()
    gconfig = GenerationHyperparameters(max_new_tokens=32, ignore_eos=True, max_tokens=64)
    tags = []
    try:
        began, tokens = time.monotonic(), 0
        for version in (0, 3):
            engine.set_version(version)
            out = await asyncio.gather(*(engine.agenerate(ModelRequest(input_ids=[5 + i, 7, 9, 11], gconfig=gconfig.new()))
                                         for i in range(16)))
            tokens += sum(r.output_len for r in out)
            right = sum(v == version for r in out for v in r.output_versions)
            total = sum(r.output_len for r in out)
            tags.append((version, right, total, all(len(r.output_versions) == r.output_len for r in out)))
        rate = tokens / (time.monotonic() - began)
    finally:
        await engine.close()
    ok = all(right == total > 0 and aligned for _, right, total, aligned in tags)
    text = ", ".join(f"{right}/{total} tokens tagged v{v}" for v, right, total, _ in tags)
    print(f"SUMMARY {'correct' if ok else 'WRONG'} ({text}); {rate:.1f} tokens/s on {engine.device}")
    sys.exit(0 if ok and str(engine.device).startswith(device.split(':')[0]) else 1)

asyncio.run(main(sys.argv[1]))
PY
step hf_engine 180 env PYTHONPATH="$B/src" "$V" "$WORK/hf_engine_check.py" "$DEVICE" || true

# 2. the example trainer's GRPO steps on the device (no broker: a dump replay)
trainer_args=(--ranks 1)
[ "$DEVICE" = cpu ] && trainer_args+=(--cpu)
step trainer 180 "$V" scripts/check_trainer_gpu.py "${trainer_args[@]}" || true

# 3. the whole pipeline: rollstream demo on the device
step demo 420 "$WORK/venv/bin/rollstream" demo --device "$DEVICE" --no-live --steps "$DEMO_STEPS" \
  --run-dir "$WORK/demo" --timeout 400 || true

# 4. pipeline vs direct generation with the HF engine on the device
# (--quick's 2 groups finish together: too short a window for a rate; 16 groups of 32 tokens)
step bench_server 300 "$V" -m bench.server --engine hf --device "$DEVICE" --quick --prompts 16 --max-new-tokens 32 \
  --out "$WORK/server.json" || true

# --- summary --------------------------------------------------------------------------------
line() {  # line NAME DETAIL: PASS with the detail and the time, or the failure
  local r="${RESULT[$1]:-FAIL  not run}"
  case "$r" in FAIL*) echo "$r" ;; *) echo "PASS  $2 (${r}s)" ;; esac
}
hf_detail="$(sed -n 's/^SUMMARY //p' "$WORK/logs/hf_engine.log" | tail -1)"
tr_pass="$(grep -c '^PASS' "$WORK/logs/trainer.log" || true)"
tr_fail="$(grep -c '^FAIL' "$WORK/logs/trainer.log" || true)"
tr_info="$(sed -n 's/^INFO rank 0: //p' "$WORK/logs/trainer.log" | tail -1)"
demo_reward="$(grep -oE 'reward mean first [0-9]+ steps: [0-9.]+ / last [0-9]+ steps: [0-9.]+' "$WORK/logs/demo.log" | tail -1)"
[ -n "$demo_reward" ] || { [ -z "${RESULT[demo]:-}" ] || [[ "${RESULT[demo]}" == FAIL* ]] || { RESULT[demo]="FAIL  no reward line in the demo's output"; FAILED=1; }; }
server_detail="$("$V" - "$WORK/server.json" 2>/dev/null <<'PY' || true
import json, sys
rows = next(iter(json.load(open(sys.argv[1]))["tables"].values()))
direct, pipe = rows[0]["tokens/s"], rows[1]["tokens/s"]
print(f"direct {direct:.1f} tokens/s, pipeline {pipe:.1f} tokens/s, pipeline/direct {pipe / direct:.2f}")
PY
)"
[ -n "$server_detail" ] || { [[ "${RESULT[bench_server]:-FAIL}" == FAIL* ]] || { RESULT[bench_server]="FAIL  no table in $WORK/server.json"; FAILED=1; }; }
[ "${hf_detail#correct}" != "$hf_detail" ] || { [[ "${RESULT[hf_engine]:-FAIL}" == FAIL* ]] || { RESULT[hf_engine]="FAIL  $hf_detail"; FAILED=1; }; }

cat <<EOF

==================== rollstream GPU check: --device $DEVICE$([ "$QUICK" = 1 ] && echo " --quick") ====================
machine      : $TORCH_INFO
bundle       : ${#PARTS[@]} parts, sha256 ok; $WHEELS wheels into a venv: $INSTALLED
services     : $SERVICES
hf engine    : $(line hf_engine "tags $hf_detail")
trainer      : $(line trainer "check_trainer_gpu.py: $tr_pass PASS, $tr_fail FAIL; $tr_info")
demo         : $(line demo "$DEMO_STEPS steps, $demo_reward")
bench.server : $(line bench_server "$server_detail")
result       : $([ "$FAILED" = 0 ] && echo "ALL PASSED" || echo "FAILED") in $((SECONDS - began))s (logs: $WORK/logs)
==========================================================================================
EOF
exit "$FAILED"
