"""The offline bundle for a GPU machine without network (``scripts/bundle.sh``) and its check
(``scripts/gpu_check.sh``), dry-run on this machine.

The bundle is built for this Python (its wheels must install here), from the wheel cache under
``~/.cache/rollstream/bundle-wheels`` (a rebuild downloads nothing); every part must be at most
60 MB and match the manifest, and the joined tar its sha256. The install check runs
``gpu_check.sh --install-only``: join, verify, install every wheel into a fresh venv
(``--system-site-packages``, ``--no-index``), rollstream resolving the bundled Java, Kafka jars
and redis-server, and one start of the broker (on the jlinked runtime) and redis-server (on its
bundled libraries). The full dry run (``gpu_check.sh --device cpu --quick``: HF engine, trainer,
demo, ``bench.server``) takes minutes on this machine and runs in CI after the suite (``.ci/run``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PART_LIMIT = 60_000_000  # bytes: 60 MB
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = pytest.mark.timeout(600)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    done = subprocess.run(["bash", "scripts/bundle.sh", str(out), "--python", PYTHON], cwd=ROOT,
                          capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


def test_bundle_parts_fit_and_match_the_manifest(bundle: Path) -> None:
    manifest = dict(reversed(line.split("  ", 1)) for line in (bundle / "MANIFEST.sha256").read_text().splitlines())
    parts = sorted(bundle.glob("rollstream-bundle.tar.gz.part-*"))
    assert parts and sorted(p.name for p in parts) == sorted(n for n in manifest if ".part-" in n), manifest
    whole = hashlib.sha256()
    for part in parts:
        assert part.stat().st_size <= PART_LIMIT, f"{part.name}: {part.stat().st_size} bytes > {PART_LIMIT}"
        assert sha256(part) == manifest[part.name], part.name
        whole.update(part.read_bytes())
    assert whole.hexdigest() == manifest["rollstream-bundle.tar.gz"]
    readme = (bundle / "README.txt").read_text()
    assert "cat rollstream-bundle.tar.gz.part-*" in readme and "gpu_check.sh" in readme, readme
    assert (bundle / "gpu_check.sh").read_text() == (ROOT / "scripts" / "gpu_check.sh").read_text()


def test_bundle_installs_and_starts_its_services(bundle: Path, tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(bundle / "gpu_check.sh"), str(bundle), "--device", "cpu", "--install-only",
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=540,
                          check=False, env={**os.environ, "PYTHON": sys.executable})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "--install-only" in line and "Kafka" in line and "Redis" in line, output[-3000:]
    assert "modules import)" in line, line  # every installed module imported, the CLI started
    for what in ("java jre/bin/java", "kafka jars cache/kafka-", "redis-server redis/bin/redis-server"):
        assert what in line, line
