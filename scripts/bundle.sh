#!/usr/bin/env bash
# An offline bundle for a GPU machine that has only Python and torch (no network, no Java, no
# Kafka, no redis-server): everything else the whole pipeline needs, as a gzipped tar split into
# parts of at most 60 MB, with a manifest (sha256 of each part and of the whole) and a README.
#
#   bash scripts/bundle.sh OUT_DIR [--python 3.12] [--platform manylinux_2_28_x86_64 ...]
#
# In the tar (rollstream-bundle/):
#   wheels/        rollstream's wheel and the wheels of its runtime dependencies except torch (and
#                  so except torch's own: nvidia-*, triton), for --python / --platform (default
#                  3.12, manylinux_2_28_x86_64 + manylinux2014_x86_64), pinned to the versions
#                  installed here (the tested set); wheels/requirements.txt lists them
#   jre/           a Java runtime made with jlink (the modules the Kafka broker needs)
#   cache/         kafka-<version>/libs: the broker jars, laid out as rollstream's cache
#                  (ROLLSTREAM_CACHE_DIR), so nothing is resolved with Maven there
#   redis/         bin/redis-server (a wrapper), libexec/redis-server (Debian's binary) and lib/
#                  (the shared libraries it links beyond glibc, libstdc++ and libgcc)
#   src/           bench/, harness/, examples/ and scripts/ of this checkout (not in the wheel;
#                  the GPU check runs them)
# Beside the parts: MANIFEST.sha256, README.txt and gpu_check.sh (join, verify, install, check).
#
# The wheel downloads are cached under ~/.cache/rollstream/bundle-wheels (keyed by the
# requirement set, Python and platforms): a rebuild with the same inputs needs no network.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

die() { echo "bundle.sh: error: $*" >&2; exit 1; }
say() { echo "bundle.sh: $*" >&2; }
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

OUT="" PYVER="3.12" PLATFORMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) [ $# -ge 2 ] || die "--python needs a version (e.g. 3.12)"; PYVER="$2"; shift 2 ;;
    --platform) [ $# -ge 2 ] || die "--platform needs a pip platform tag"; PLATFORMS+=("$2"); shift 2 ;;
    -h|--help) usage ;;
    -*) die "unknown option $1" ;;
    *) [ -z "$OUT" ] || die "one OUT_DIR only (got $OUT and $1)"; OUT="$1"; shift ;;
  esac
done
[ -n "$OUT" ] || usage
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || die "--python $PYVER: want MAJOR.MINOR, e.g. 3.12"
[ ${#PLATFORMS[@]} -gt 0 ] || PLATFORMS=(manylinux_2_28_x86_64 manylinux2014_x86_64)
PART_SIZE="${ROLLSTREAM_BUNDLE_PART_SIZE:-60000000}"  # bytes: 60 MB (under 60 MiB too)
CACHE="${ROLLSTREAM_CACHE_DIR:-$HOME/.cache/rollstream}"
PY="${PYTHON:-python}"
# The broker's modules (jdeps --print-module-deps on kafka*.jar and scala-library: java.base,
# java.logging, java.management, java.rmi, java.security.jgss, java.security.sasl,
# jdk.unsupported), with log4j's and jackson's (java.desktop for java.beans, java.naming, java.sql, java.xml), TLS's
# (jdk.crypto.ec) and the JVM's management beans (jdk.management); the local broker starts with it.
JAVA_MODULES="${ROLLSTREAM_BUNDLE_JAVA_MODULES:-java.base,java.desktop,java.logging,java.management,java.naming,java.rmi,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.crypto.ec,jdk.management,jdk.unsupported,jdk.zipfs}"

for tool in "$PY" jlink sha256sum split tar gzip ldd; do
  command -v "$tool" >/dev/null || die "$tool not found (the build machine needs it: Python with pip, a JDK with jlink, coreutils, ldd)"
done
REDIS_BIN="$(command -v redis-server || true)"
[ -n "$REDIS_BIN" ] || die "redis-server not found: apt-get install redis-server (bash scripts/setup.sh does)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
began=$SECONDS

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rollstream-bundle.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
STAGE="$WORK/rollstream-bundle"
mkdir -p "$STAGE/wheels" "$STAGE/src" "$STAGE/redis/bin" "$STAGE/redis/libexec" "$STAGE/redis/lib"

# --- the source: this checkout's tracked and untracked (not ignored) files -------------------
say "copying the checkout (git ls-files)"
SRC="$WORK/checkout"
mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -C "$SRC" -xf -
for d in bench harness examples scripts; do
  [ -d "$SRC/$d" ] || die "$d/ missing from the checkout"
  cp -a "$SRC/$d" "$STAGE/src/"
done

# --- wheels ---------------------------------------------------------------------------------
say "building rollstream's wheel"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$STAGE/wheels" "$SRC" >/dev/null \
  || die "pip wheel --no-deps . failed (setuptools>=68 and wheel must be installed)"
ROLLSTREAM_WHEEL="$(ls "$STAGE"/wheels/rollstream-*.whl)"

# runtime dependencies from pyproject.toml, torch left out; pins: the versions installed here
"$PY" - "$SRC/pyproject.toml" > "$WORK/requirements.in" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
for dep in deps:
    name = re.split(r"[ <>=!~\[;]", dep, maxsplit=1)[0].lower()
    if name != "torch":
        print(dep)
print("pip")  # gpu_check.sh bootstraps a venv with it where the Python has no ensurepip
PY
"$PY" -m pip freeze --all 2>/dev/null | grep -E '^[A-Za-z0-9_.-]+==[^ ]+$' \
  | grep -viE '^(torch|torchvision|torchaudio|triton|nvidia-[^=]*|rollstream)==' \
  | grep -vE '\+' > "$WORK/constraints.txt" || true
key="$(cat "$WORK/requirements.in" "$WORK/constraints.txt" <(echo "$PYVER ${PLATFORMS[*]}") | sha256sum | cut -c1-16)"
WHEEL_CACHE="$CACHE/bundle-wheels/py$PYVER-$key"
mkdir -p "$WHEEL_CACHE"
if [ -s "$WHEEL_CACHE/wheels.txt" ] && while read -r f; do [ -f "$WHEEL_CACHE/$f" ] || exit 1; done < "$WHEEL_CACHE/wheels.txt"; then
  say "dependency wheels: cached ($WHEEL_CACHE, $(wc -l < "$WHEEL_CACHE/wheels.txt") wheels)"
else
  say "downloading dependency wheels for Python $PYVER on ${PLATFORMS[*]} into $WHEEL_CACHE"
  platform_args=()
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  if ! "$PY" -m pip download --only-binary=:all: --python-version "$PYVER" "${platform_args[@]}" \
        -r "$WORK/requirements.in" -c "$WORK/constraints.txt" -d "$WHEEL_CACHE" > "$WORK/download.log" 2>&1; then
    tail -20 "$WORK/download.log" >&2
    die "pip download failed (above); with no wheel for a pinned version, install a newer one here or pick another --python"
  fi
  grep -oE '(Saved|File was already downloaded) [^ ]+\.whl' "$WORK/download.log" | awk '{print $NF}' \
    | xargs -n1 basename | sort -u > "$WHEEL_CACHE/wheels.txt.new"
  [ -s "$WHEEL_CACHE/wheels.txt.new" ] || die "pip download saved no wheel (log: $(tail -3 "$WORK/download.log"))"
  mv "$WHEEL_CACHE/wheels.txt.new" "$WHEEL_CACHE/wheels.txt"
fi
if grep -qiE '^(torch|triton|nvidia_)' "$WHEEL_CACHE/wheels.txt"; then
  die "a dependency pulled in torch, triton or nvidia-* ($(grep -iE '^(torch|triton|nvidia_)' "$WHEEL_CACHE/wheels.txt" | tr '\n' ' ')): the target's own torch must be used"
fi
while read -r f; do cp "$WHEEL_CACHE/$f" "$STAGE/wheels/"; done < "$WHEEL_CACHE/wheels.txt"
# name==version of every dependency wheel: what gpu_check.sh installs (--no-deps)
sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/' "$WHEEL_CACHE/wheels.txt" > "$STAGE/wheels/requirements.txt"
say "wheels: $(ls "$STAGE"/wheels/*.whl | wc -l) ($(du -sh "$STAGE/wheels" | cut -f1)), rollstream: $(basename "$ROLLSTREAM_WHEEL")"

# --- Java runtime (jlink) and the Kafka jars ------------------------------------------------
JAVA_VERSION="$(java -version 2>&1 | head -1)"
jre_key="$(echo "$JAVA_MODULES $JAVA_VERSION" | sha256sum | cut -c1-16)"
JRE_CACHE="$CACHE/bundle-jre/$jre_key"
if [ ! -x "$JRE_CACHE/bin/java" ]; then
  say "jlink: a Java runtime with $JAVA_MODULES"
  rm -rf "$JRE_CACHE.partial"
  mkdir -p "$(dirname "$JRE_CACHE")"
  jlink --add-modules "$JAVA_MODULES" --strip-debug --no-man-pages --no-header-files --compress=2 \
        --output "$JRE_CACHE.partial" || die "jlink failed (a JDK with jmods is needed: openjdk-17-jdk-headless)"
  rm -rf "$JRE_CACHE"
  mv "$JRE_CACHE.partial" "$JRE_CACHE"
else
  say "Java runtime: cached ($JRE_CACHE)"
fi
cp -a "$JRE_CACHE" "$STAGE/jre"
"$STAGE/jre/bin/java" -version >/dev/null 2>&1 || die "the jlinked java does not start: $STAGE/jre/bin/java -version"

say "Kafka jars (rollstream.dev.kafka_jars: cached, else resolved with Maven)"
KAFKA_LIBS="$(cd "$SRC" && "$PY" -c 'from rollstream.dev.kafka_jars import ensure_kafka_jars; print(ensure_kafka_jars())')" \
  || die "the Kafka jars could not be found or resolved (run bash scripts/setup.sh first)"
KAFKA_VERSION="$(cd "$SRC" && "$PY" -c 'from rollstream.dev.kafka_jars import KAFKA_VERSION; print(KAFKA_VERSION)')"
mkdir -p "$STAGE/cache/kafka-$KAFKA_VERSION"
cp -a "$KAFKA_LIBS" "$STAGE/cache/kafka-$KAFKA_VERSION/libs"
# the marker rollstream checks before using a cache: the sha256 of the pom in the wheel
sha256sum "$SRC/rollstream/dev/pom.xml" | cut -d' ' -f1 > "$STAGE/cache/kafka-$KAFKA_VERSION/.complete"
"$STAGE/jre/bin/java" -cp "$STAGE/cache/kafka-$KAFKA_VERSION/libs/*" kafka.Kafka --version >/dev/null 2>&1 \
  || die "the jlinked java cannot run kafka.Kafka --version (add modules with ROLLSTREAM_BUNDLE_JAVA_MODULES)"

# --- redis-server and the shared libraries it links -----------------------------------------
say "redis-server: $(readlink -f "$REDIS_BIN") and its libraries"
cp -L "$REDIS_BIN" "$STAGE/redis/libexec/redis-server"
ldd "$REDIS_BIN" | awk '/=> \//{print $1, $3}' | while read -r name path; do
  case "$name" in
    libc.so.*|libm.so.*|libstdc++.so.*|libgcc_s.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*) ;;
    *) cp -L "$path" "$STAGE/redis/lib/$name" ;;
  esac
done
cat > "$STAGE/redis/bin/redis-server" <<'SH'
#!/bin/sh
# Debian's redis-server with the libraries it links beside it (rollstream finds it on PATH)
here="$(cd "$(dirname "$0")/.." && pwd)"
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/redis-server" "$@"
SH
chmod +x "$STAGE/redis/bin/redis-server"
"$STAGE/redis/bin/redis-server" --version >/dev/null || die "the bundled redis-server does not start"
GLIBC_NEEDED="$( (objdump -T "$STAGE/redis/libexec/redis-server" "$STAGE"/redis/lib/*.so* 2>/dev/null || true) \
  | grep -oE 'GLIBC_[0-9]+\.[0-9]+' | sort -t. -k2 -n | tail -1)"
GLIBC_NEEDED="${GLIBC_NEEDED:-GLIBC_?}"  # ? without objdump (binutils)

# --- pack, split, manifest ------------------------------------------------------------------
cat > "$STAGE/BUNDLE_INFO" <<EOF
built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), from $(git rev-parse --short HEAD 2>/dev/null || echo '?')
python: $PYVER
platforms: ${PLATFORMS[*]}
rollstream wheel: $(basename "$ROLLSTREAM_WHEEL")
java: $JAVA_VERSION (jlink: $JAVA_MODULES)
kafka: $KAFKA_VERSION
redis: $("$STAGE/redis/bin/redis-server" --version | head -1)
redis needs glibc: ${GLIBC_NEEDED#GLIBC_} or newer
EOF
say "packing $(du -sh "$STAGE" | cut -f1) into parts of $PART_SIZE bytes"
rm -f "$OUT"/rollstream-bundle.tar.gz.part-* "$OUT/MANIFEST.sha256" "$OUT/README.txt" "$OUT/gpu_check.sh"
tar -C "$WORK" -cf - rollstream-bundle | gzip -1 \
  | tee >(sha256sum | cut -d' ' -f1 > "$WORK/whole.sha256") \
  | split -b "$PART_SIZE" -d -a 2 - "$OUT/rollstream-bundle.tar.gz.part-"
for _ in $(seq 50); do [ -s "$WORK/whole.sha256" ] && break; sleep 0.1; done
[ -s "$WORK/whole.sha256" ] || die "the sha256 of the whole tar was not written"
(cd "$OUT" && sha256sum rollstream-bundle.tar.gz.part-* && echo "$(cat "$WORK/whole.sha256")  rollstream-bundle.tar.gz") \
  > "$OUT/MANIFEST.sha256"
cp "$REPO/scripts/gpu_check.sh" "$OUT/gpu_check.sh"
cat > "$OUT/README.txt" <<EOF
rollstream offline bundle ($(basename "$ROLLSTREAM_WHEEL"), Python $PYVER, ${PLATFORMS[*]}; needs Python + torch, glibc ${GLIBC_NEEDED#GLIBC_}+)
Join and install: copy this directory over, then \`bash gpu_check.sh .\` (verifies MANIFEST.sha256, joins, installs into a venv and runs the GPU checks; --device cpu|cuda, --quick), or by hand: \`sha256sum -c --ignore-missing MANIFEST.sha256 && cat rollstream-bundle.tar.gz.part-* > rollstream-bundle.tar.gz && sha256sum -c MANIFEST.sha256 && tar xzf rollstream-bundle.tar.gz && python -m venv --system-site-packages venv && venv/bin/pip install --no-index --find-links rollstream-bundle/wheels --no-deps rollstream-bundle/wheels/*.whl\`, then JAVA_HOME=rollstream-bundle/jre PATH=rollstream-bundle/redis/bin:\$PATH ROLLSTREAM_CACHE_DIR=<a writable copy of rollstream-bundle/cache>.
EOF
say "done in $((SECONDS - began))s: $OUT"
ls -l "$OUT" >&2
