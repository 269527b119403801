"""Every benchmark and every script is run by some test, or exempt with a written reason.

What this guarantees (issue 42, item 3):

- each entry point (``bench/*.py`` with a ``main``, a ``bench/`` package run with ``python -m``,
  ``bench/*.sh``, every file under ``scripts/``) is in exactly one of ``COVERED`` (the test that
  runs it in its smallest form), ``HELPERS`` (a module that only others import or start, with
  the one that does) or ``EXEMPT`` (why no test runs it); a new benchmark or script without a
  smoke test fails here, and so does an entry left behind by a rename;
- each test named in ``COVERED`` exists and names what it runs; each helper is imported (or
  started) by the module named beside it, and that module is itself covered;
- the exempt entry points still import and build their argument parsers (``--help``), every
  shell script parses (``bash -n``), and the benchmark lists of ``bench/run_all.sh`` and
  ``bench.summary`` name benchmarks that exist.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = "tests/integration/test_bench_smoke.py"
SCRIPTS_SMOKE = "tests/integration/test_scripts_smoke.py"

# entry point (path from the repository root) -> the test that runs it ("file::function")
COVERED: dict[str, str] = {
    "bench/codec.py": f"{SMOKE}::test_broker_free_benchmarks_run",
    "bench/grouping.py": f"{SMOKE}::test_broker_free_benchmarks_run",
    "bench/inprocess.py": f"{SMOKE}::test_broker_free_benchmarks_run",
    "bench/memory.py": f"{SMOKE}::test_broker_free_benchmarks_run",
    "bench/reward.py": f"{SMOKE}::test_reward_tier_benchmark_runs",
    "bench/pipeline.py": f"{SMOKE}::test_pipeline_benchmark_runs",
    "bench/latency.py": f"{SMOKE}::test_latency_benchmark_runs",
    "bench/trainer.py": f"{SMOKE}::test_trainer_benchmark_runs",
    "bench/server.py": f"{SMOKE}::test_server_benchmark_runs_on_the_vllm_server",
    "bench/weights.py": f"{SMOKE}::test_weights_benchmark_runs_on_the_keep_server",
    "bench/elastic.py": f"{SMOKE}::test_elastic_benchmark_runs",
    "bench/scale_out.py": f"{SMOKE}::test_scale_out_benchmark_runs",
    "bench/sizing.py": f"{SMOKE}::test_sizing_benchmark_runs",
    "bench/summary.py": f"{SMOKE}::test_summary_tabulates_the_committed_results",
    "bench/chaos": "tests/faults/test_chaos.py::test_a_short_chaos_run_breaks_no_invariant",
    "scripts/check_trainer_gpu.py": f"{SCRIPTS_SMOKE}::test_check_trainer_gpu_runs_on_cpu",
    "scripts/check_sglang.py": "tests/unit/test_check_sglang.py::test_every_check_passes_against_the_standin",
    "scripts/demo.sh": f"{SCRIPTS_SMOKE}::test_demo_script_reaches_the_demo",
    "scripts/bundle.sh": "tests/integration/test_bundle.py::test_bundle_parts_fit_and_match_the_manifest",
    "scripts/gpu_check.sh": "tests/integration/test_bundle.py::test_bundle_installs_and_starts_its_services",
}

# a module no one runs by itself -> the module that imports (or starts) it
HELPERS: dict[str, str] = {
    "bench/common.py": "bench/codec.py",
    "bench/data.py": "bench/codec.py",
    "bench/kafka_tools.py": "bench/pipeline.py",
    "bench/load_engine.py": "bench/inprocess.py",
    "bench/pipeline_run.py": "bench/pipeline.py",
    "bench/trainer_rank.py": "bench/trainer.py",  # under torchrun
    "bench/workflow_memory.py": "bench/memory.py",  # part 3 of bench.memory, in its quick run
}

# entry point -> why no test runs it
EXEMPT: dict[str, str] = {
    "bench/compose_run.py": "needs a Docker engine and the images of scripts/images.sh; CI runs it after the "
                            "suite (.ci/run -> scripts/compose_check.sh)",
    "bench/run_all.sh": "runs every benchmark at full size (minutes) and writes bench/results/; each benchmark "
                        "has its own smoke test, and its list of names is checked here",
    "scripts/setup.sh": "installs packages, the Kafka jars and vLLM; CI runs it before the suite (scripts/test.sh)",
    "scripts/test.sh": "runs this test suite; it is CI's command (.ci/run)",
    "scripts/compose_check.sh": "installs and starts Docker and builds every image; CI runs it after the suite "
                                "(.ci/run)",
    "scripts/images.sh": "needs a Docker engine (and root with debootstrap); scripts/compose_check.sh runs it in CI",
}

# run by no test through their main: their imports and options are checked here
HELP_MODULES = ("bench.compose_run", "bench.chaos.__main__")


def entry_points() -> set[str]:
    """Every benchmark module, benchmark package, benchmark shell script and script, by path."""
    bench = ROOT / "bench"
    found = {f"bench/{p.name}" for p in bench.glob("*.py") if p.name != "__init__.py"}
    found |= {f"bench/{p.parent.name}" for p in bench.glob("*/__main__.py")}
    found |= {f"bench/{p.name}" for p in bench.glob("*.sh")}
    found |= {f"scripts/{p.name}" for p in (ROOT / "scripts").iterdir() if p.is_file()}
    return found


def mentions(entry: str) -> re.Pattern[str]:
    """What a test that runs ``entry`` must say: its module name, or its file name."""
    name = Path(entry).stem if entry.endswith(".py") else Path(entry).name
    if entry.startswith("bench/") and not entry.endswith(".sh"):
        return re.compile(rf"bench\.{name}\b|[\"']{name}[\"']")
    return re.compile(re.escape(Path(entry).name))


def test_every_entry_point_is_covered_or_exempt() -> None:
    listed = [*COVERED, *HELPERS, *EXEMPT]
    assert len(listed) == len(set(listed)), "an entry point is in more than one of COVERED, HELPERS, EXEMPT"
    missing = sorted(entry_points() - set(listed))
    assert not missing, f"no smoke test runs {missing}: add one and name it in COVERED (or exempt it with a reason)"
    stale = sorted(set(listed) - entry_points())
    assert not stale, f"{stale} no longer exist(s): renamed? update this file and the test that runs it"


@pytest.mark.parametrize("entry", sorted(COVERED))
def test_the_named_test_exists_and_runs_it(entry: str) -> None:
    path, function = COVERED[entry].split("::")
    source = (ROOT / path).read_text()
    assert re.search(rf"^(async )?def {function}\(", source, re.MULTILINE), f"{COVERED[entry]} does not exist"
    assert mentions(entry).search(source), f"{path} never names {entry}"


@pytest.mark.parametrize("helper", sorted(HELPERS))
def test_each_helper_is_used_by_a_covered_module(helper: str) -> None:
    user = HELPERS[helper]
    stem = Path(helper).stem
    used = re.compile(rf"from bench\.{stem} import|import bench\.{stem}\b|bench\.{stem}:|\"{stem}\.py\"")
    assert used.search((ROOT / user).read_text()), f"{user} no longer imports or starts {helper}"
    assert user in COVERED, f"{user}, the module that runs {helper}, has no smoke test"


def test_every_exemption_says_why() -> None:
    assert all(len(reason) > 30 for reason in EXEMPT.values()), EXEMPT


@pytest.mark.parametrize("module", HELP_MODULES)
def test_entry_points_no_test_runs_build_their_parser(module: str) -> None:
    """Their imports and options still resolve (``bench.chaos``'s run is tested without its main)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(["--help"])
    assert stop.value.code == 0 and "--quick" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("script", sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("scripts/*.sh"),
                                                                          *ROOT.glob("bench/*.sh")]))
def test_shell_script_parses(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{script}: {done.stderr}"


def run_all_names() -> list[str]:
    """The benchmarks ``bench/run_all.sh`` runs in turn (its ``for name in ...`` loop)."""
    match = re.search(r"^for name in ([\w ]+); do", (ROOT / "bench" / "run_all.sh").read_text(), re.MULTILINE)
    assert match, "bench/run_all.sh has no `for name in ...; do` loop any more"
    return match.group(1).split()


def test_run_all_and_summary_name_covered_benchmarks() -> None:
    from bench import summary

    names = run_all_names()
    assert set(summary.ORDER) <= set(names), "bench.summary tabulates a benchmark run_all.sh does not run"
    for name in names:
        assert f"bench/{name}.py" in COVERED, f"bench/run_all.sh runs bench.{name}, which has no smoke test"
        source = (ROOT / f"bench/{name}.py").read_text()
        assert re.search(r"^def main\(", source, re.MULTILINE), f"bench.{name} has no main"
