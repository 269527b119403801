"""One installed namespace: the tier folders are installed as ``rollstream.<tier>``, and
pyproject's package list holds every package of the tree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("producers", "consumers", "rollout_workers", "reward_workers")


def test_pyproject_installs_every_package_of_the_tree_under_rollstream() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "rollstream").rglob("__init__.py")}
    tree |= {".".join(("rollstream", *p.parent.relative_to(REPO).parts)) for tier in TIERS
             for p in (REPO / tier).rglob("__init__.py")}
    assert set(setuptools["packages"]) == tree, "pyproject's package list differs from the tree"
    assert setuptools["package-dir"] == {f"rollstream.{tier}": tier for tier in TIERS}


def test_tier_entry_points_name_the_installed_modules() -> None:
    tiers = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["rollstream.tiers"]
    assert all(target.startswith("rollstream.") for target in tiers.values()), tiers


def test_the_tiers_import_and_run_under_rollstream(tmp_path: Path) -> None:
    """From outside the checkout: the installed tier packages, and ``python -m rollstream.<tier>``."""
    code = ("import rollstream.producers.service, rollstream.consumers.grouping.service, "
            "rollstream.rollout_workers.registry, rollstream.reward_workers.service\n"
            "from rollstream.rewards import exact_match_reward\n"
            "import rollstream.consumers as c; print(c.__file__)")
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(REPO / "consumers" / "__init__.py")
    result = subprocess.run([sys.executable, "-m", "rollstream.consumers", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout, "the grouping tier's command line did not run"
