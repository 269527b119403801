"""``pip install .`` into a fresh virtual environment puts one package in site-packages:
``rollstream`` (the tiers inside it), and nothing else: no ``.pth``, no top-level tier names.

The wheel is built from a copy of this checkout's files (as ``scripts/bundle.sh`` builds it: no
stale ``build/`` folder) and installed without dependencies (no network needed): what is checked is
what the package installs (every source file of the tree, nothing else), and the tier packages
import nothing heavy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.unit.test_namespace import source_folders

REPO = Path(__file__).resolve().parents[2]


def run(argv: list[str], cwd: Path) -> str:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{argv}: {result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, set[str]]:
    """(the venv's python, its site-packages, what the install added there) with this
    checkout's wheel installed."""
    root = tmp_path_factory.mktemp("namespace")
    checkout = root / "checkout"
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
         str(checkout)], cwd=root)
    venv.create(root / "venv", with_pip=True)  # ensurepip: offline
    python = root / "venv" / "bin" / "python"
    wheel = next((root / "dist").glob("rollstream-*.whl"))
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).strip())
    before = {p.name for p in site.iterdir()}
    # the venv's own pip: the outer one would uninstall this environment's rollstream first
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--disable-pip-version-check",
         str(wheel)], cwd=root)
    return python, site, {p.name for p in site.iterdir()} - before


def test_only_rollstream_is_installed(fresh_install: tuple[Path, Path, set[str]]) -> None:
    _, site, added = fresh_install
    assert added == {"rollstream", "rollstream-0.2.0.dist-info"}, added
    for tier in ("producers", "consumers", "rollout_workers", "reward_workers"):
        assert (site / "rollstream" / tier / "__init__.py").is_file(), tier


def test_the_installed_tiers_import_and_the_old_names_do_not(fresh_install: tuple[Path, Path, set[str]],
                                                             tmp_path: Path) -> None:
    python, site, _ = fresh_install
    code = (
        "import importlib.util, sys\n"
        "import rollstream.producers, rollstream.consumers, rollstream.rollout_workers, rollstream.reward_workers\n"
        "from rollstream.rewards import exact_match_reward\n"
        "print(rollstream.producers.__file__)\n"
        "print([n for n in ('producers', 'consumers', 'rollout_workers', 'reward_workers') if importlib.util.find_spec(n)])\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers', 'numpy')))\n"
    )
    out = run([str(python), "-c", code], cwd=tmp_path).splitlines()
    assert Path(out[0]).is_relative_to(site), out[0]  # the installed copy, not the checkout
    assert out[1] == "[]", f"old top-level names importable: {out[1]}"
    assert out[2] == "[]", f"the tier packages imported {out[2]}"


def test_the_installed_package_holds_every_source_file_of_the_tree(fresh_install: tuple[Path, Path, set[str]]) -> None:
    """A folder left out of the wheel imports from a checkout but not once installed (the
    installed ``rollstream`` command failed so, on ``rollstream.tier``)."""
    _, site, _ = fresh_install
    tree = {"/".join((*name.split("."), f.name)) for name, folder in source_folders().items()
            for f in folder.iterdir() if f.suffix in (".py", ".xml", ".properties")}
    installed = {p.relative_to(site).as_posix() for p in (site / "rollstream").rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert tree - installed == set(), "files of the tree missing from the installed package"
    assert {n for n in installed if n.endswith(".py")} - tree == set(), "installed files that are not in the tree"
