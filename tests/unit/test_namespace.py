"""One installed namespace: the tier folders are installed as ``rollstream.<tier>``, and
pyproject's package list holds every package of the tree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIERS = ("producers", "consumers", "rollout_workers", "reward_workers")


def source_folders() -> dict[str, Path]:
    """Every folder of the product that holds Python files, by the package name it installs as."""
    dirs = {".".join(p.parent.relative_to(REPO).parts): p.parent for p in (REPO / "rollstream").rglob("*.py")}
    dirs |= {".".join(("rollstream", *p.parent.relative_to(REPO).parts)): p.parent for tier in TIERS
             for p in (REPO / tier).rglob("*.py")}
    return {name: path for name, path in dirs.items() if "__pycache__" not in name}


def test_every_folder_with_python_files_is_a_package_in_pyproject() -> None:
    """A folder without ``__init__.py`` imports from the checkout (a namespace package) but is
    left out of the wheel: the installed ``rollstream`` CLI then fails on import."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = source_folders()
    assert not [n for n, d in dirs.items() if not (d / "__init__.py").exists()], "folders without __init__.py"
    assert set(setuptools["packages"]) == set(dirs), "pyproject's package list differs from the tree"
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
