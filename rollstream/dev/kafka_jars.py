"""Resolve and cache the Apache Kafka broker jars with Maven.

`ensure_kafka_jars()` runs `mvn dependency:copy-dependencies` on the pom shipped in this package
once per cache directory, guarded by a file lock so concurrent processes (pytest-xdist workers, two
terminals) download only once. The cache lives outside the repository:
`$ROLLSTREAM_CACHE_DIR/kafka-<version>/libs`, with ROLLSTREAM_CACHE_DIR defaulting to
`~/.cache/rollstream`. A marker file records the pom's hash; editing the pom refreshes the cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from rollstream.config import cache_dir
from rollstream.dev.processes import MissingToolError

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"  # keep in step with <kafka.version> in pom.xml
POM_PATH = Path(__file__).with_name("pom.xml")
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
MAVEN_TIMEOUT_S = 1200.0
_MARKER = ".complete"


def java_executable() -> str:
    """The `java` to run the broker with: $JAVA_HOME/bin/java, else java on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise MissingToolError(
            "java not found: the local Kafka broker needs Java 17+ "
            "(e.g. `apt-get install openjdk-17-jre-headless`), or set KAFKA_BOOTSTRAP_SERVERS "
            "to use an existing broker"
        )
    return found


def classpath(libs: Path) -> str:
    return str(libs / "*")


def ensure_kafka_jars() -> Path:
    """Return the directory holding the broker's runtime jars, downloading them if needed.

    Safe to call from several processes at once. Raises MissingToolError when java or mvn is
    missing and RuntimeError (with Maven's output) when resolution fails.
    """
    java_executable()
    target = cache_dir() / f"kafka-{KAFKA_VERSION}"
    libs = target / "libs"
    want = hashlib.sha256(POM_PATH.read_bytes()).hexdigest()
    if _is_complete(target, want):
        return libs
    target.mkdir(parents=True, exist_ok=True)
    with (target / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(target, want):  # another process may have finished meanwhile
            _download(target, libs, want)
    return libs


def _is_complete(target: Path, digest: str) -> bool:
    marker = target / _MARKER
    return marker.is_file() and marker.read_text().strip() == digest and (target / "libs").is_dir()


def _download(target: Path, libs: Path, digest: str) -> None:
    mvn = shutil.which("mvn")
    if mvn is None:
        raise MissingToolError(
            "mvn not found: the Kafka broker jars are resolved from Maven Central with Maven "
            "(`apt-get install maven`), or set KAFKA_BOOTSTRAP_SERVERS to use an existing broker"
        )
    staging = target / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    argv = [
        mvn, "-q", "-B", "-f", str(POM_PATH), "dependency:copy-dependencies",
        "-DincludeScope=runtime", f"-DoutputDirectory={staging}",
    ]
    logger.info("resolving Kafka %s jars into %s (first use only)", KAFKA_VERSION, libs)
    began = time.monotonic()
    result = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=MAVEN_TIMEOUT_S,
        # the pom's directory may be read-only (site-packages): keep Maven's target/ elsewhere
        cwd=target,
    )
    if result.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        output = (result.stdout + result.stderr)[-4000:]
        raise RuntimeError(f"mvn failed (exit {result.returncode}) resolving Kafka jars:\n{output}")
    shutil.rmtree(libs, ignore_errors=True)
    staging.rename(libs)
    (target / _MARKER).write_text(digest + "\n")
    logger.info("Kafka jars ready in %.1fs", time.monotonic() - began)
