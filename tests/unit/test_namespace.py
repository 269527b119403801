"""One installed namespace: the tiers are ``rollstream.<tier>``; the pre-0.2 names warn and work.

Old names are imported in fresh interpreters (a module imported once stays imported), from a
directory outside the checkout (through the installed hook) and from the checkout's root (where
the tier folders themselves are on ``sys.path``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from rollstream._names import TIERS, new_name

REPO = Path(__file__).resolve().parents[2]

OLD_IMPORTS = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import producers.service
    from consumers.batch_consumer import BatchConsumer
    from reward_workers.rewards import exact_match_reward
    import rollout_workers.registry as old_registry
import rollstream.producers.service, rollstream.consumers.batch_consumer, rollstream.rewards
import rollstream.rollout_workers.registry
assert producers.service is rollstream.producers.service
assert BatchConsumer is rollstream.consumers.batch_consumer.BatchConsumer
assert exact_match_reward is rollstream.rewards.exact_match_reward
assert old_registry is rollstream.rollout_workers.registry
import sys
assert sys.modules["producers"] is sys.modules["rollstream.producers"]
for name in ("rollstream.producers", "rollstream.producers.service", "rollstream.rewards"):
    assert sys.modules[name].__spec__.name == name, sys.modules[name].__spec__  # the old import left it alone
messages = sorted({str(w.message) for w in caught if w.category is DeprecationWarning})
print("\\n".join(messages))
"""


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_pyproject_installs_every_package_of_the_tree_under_rollstream() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "rollstream").rglob("__init__.py")}
    tree |= {f"rollstream.{tier}" for tier in TIERS}
    assert set(setuptools["packages"]) == tree, "pyproject's package list differs from the tree"
    assert setuptools["package-dir"] == {f"rollstream.{tier}": tier for tier in TIERS}
    assert not any((REPO / tier / sub / "__init__.py").exists() for tier in TIERS for sub in
                   [d.name for d in (REPO / tier).iterdir() if d.is_dir()]), "a tier subpackage needs listing"


def test_tier_entry_points_name_the_new_modules() -> None:
    tiers = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["rollstream.tiers"]
    assert all(target.startswith("rollstream.") for target in tiers.values()), tiers


@pytest.mark.parametrize("where", ["outside the checkout", "checkout root"])
def test_old_names_warn_and_give_the_same_modules(where: str, tmp_path: Path) -> None:
    result = run_python(OLD_IMPORTS, tmp_path if where == "outside the checkout" else REPO)
    assert result.returncode == 0, result.stderr
    messages = result.stdout.splitlines()
    for old, new in [("producers.service", "rollstream.producers.service"),
                     ("consumers.batch_consumer", "rollstream.consumers.batch_consumer"),
                     ("reward_workers.rewards", "rollstream.rewards")]:
        assert f"'{old}' is deprecated and will be removed in a release after 0.2: import '{new}'" in messages


def test_a_script_sees_the_warning_with_default_filters(tmp_path: Path) -> None:
    script = tmp_path / "old_trainer.py"
    script.write_text("from consumers.batch_consumer import BatchConsumer\n")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{script}:1: DeprecationWarning: 'consumers.batch_consumer' is deprecated" in result.stderr


def test_new_names_import_without_warnings(tmp_path: Path) -> None:
    code = ("import rollstream.producers.service, rollstream.consumers.grouping_service, "
            "rollstream.rollout_workers.registry, rollstream.reward_workers.service, rollstream.rewards")
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:rollstream._names", "-c", code],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_new_name_maps_only_the_old_tier_names() -> None:
    assert new_name("consumers.grouping") == "rollstream.consumers.grouping"
    assert new_name("reward_workers.rewards") == "rollstream.rewards"
    assert new_name("reward_workers") == "rollstream.reward_workers"
    assert new_name("rollstream.consumers") is None
    assert new_name("consumer") is None and new_name("producersx") is None


def test_python_dash_m_with_an_old_name_still_runs_the_tier(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "consumers", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout, "the grouping tier's command line did not run"
    assert "'consumers' is deprecated and will be removed in a release after 0.2: run python -m 'rollstream.consumers'" in result.stderr


def test_another_distributions_consumers_package_is_left_alone(tmp_path: Path) -> None:
    """``consumers`` is a name other distributions use: theirs wins over our old name."""
    theirs = tmp_path / "site" / "consumers"
    theirs.mkdir(parents=True)
    (theirs / "__init__.py").write_text("OWNER = 'another distribution'\n")
    (theirs / "queue.py").write_text("VALUE = 7\n")
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import rollstream, consumers, consumers.queue\n"
            "assert consumers.OWNER == 'another distribution' and consumers.queue.VALUE == 7\n"
            "assert 'rollstream.consumers' not in __import__('sys').modules\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr


def test_a_checkout_that_is_not_installed_finds_the_tiers(tmp_path: Path) -> None:
    """``PYTHONPATH=<checkout>`` without any install (``-S``: no site-packages, no editable
    finder): ``rollstream.producers`` comes from ``<checkout>/producers``."""
    code = "import rollstream.producers as p, rollstream.consumers as c; print(p.__file__); print(c.__file__)"
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(REPO / "producers" / "__init__.py"), str(REPO / "consumers" / "__init__.py")]
