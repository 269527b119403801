"""Session fixtures: one real Kafka broker and one real Redis for the whole test session.

They come from KAFKA_BOOTSTRAP_SERVERS / REDIS_URL when set, else local processes, or
testcontainers with ROLLSTREAM_DEV_SERVICES=testcontainers (see rollstream.dev.launcher; a Docker
engine alone changes nothing). They start only when a test asks for
them, so unit tests never pay for a broker. Tests isolate their data with `unique_name` (topic
and key prefixes) instead of wiping shared state.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from harness.reports import ShowReport
from rollstream.dev.kafka_jars import KAFKA_VERSION
from rollstream.dev.launcher import DevStack, Services, dev_stack as start_dev_stack
from rollstream.config import ServerLaunchConfig
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.runtime.import_effects import undo_import_effects
from rollstream.testing.tiny import tiny_model_dir


# The workflow authors' fixtures (tiny_model_dir, tiny_tokenizer, gconfig, scripted_engine).
pytest_plugins = ["rollstream.testing.fixtures"]

@pytest.fixture(autouse=True)
def _standard_process_settings() -> None:
    """Importing AReaL (the compatibility tests do) replaces Python's logger hierarchy, which
    would hide later tests' log lines from their handlers, and the event-loop policy; every test
    starts with the standard ones."""
    undo_import_effects()


# Filled by the dev_stack fixture, printed by pytest_terminal_summary.
_startup_lines: list[str] = []


@pytest.fixture(scope="session")
def dev_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevStack]:
    """The session's services; `.broker` / `.redis` are None unless started locally."""
    with start_dev_stack(tmp_path_factory.mktemp("services")) as dev:
        if dev.broker is not None and dev.broker.startup_seconds is not None:
            _startup_lines.append(
                f"kafka broker started in {dev.broker.startup_seconds:.2f}s "
                f"(Kafka {KAFKA_VERSION}, local, {dev.broker.bootstrap})"
            )
        else:
            _startup_lines.append(f"kafka broker: {dev.services.kafka_bootstrap} ({dev.services.source})")
        yield dev


# The session's vLLM servers by fixture name. A server that exits during a test fails that test
# with its exit status and log tail (pytest_runtest_makereport); the next test that asks for it
# gets it restarted, at its launch weights (pytest_runtest_setup), so one crash is one failure
# that says why, not every later vLLM test timing out on a refused connection.
_session_servers: dict[str, LocalVLLMServer] = {}
SERVER_LOG_TAIL_LINES = 80


def _server_exit(name: str, server: LocalVLLMServer) -> str:
    lines = server.log_path.read_text(errors="replace").splitlines()[-SERVER_LOG_TAIL_LINES:]
    return f"{name} exited with status {server.exit_code()}; the last lines of {server.log_path}:\n" + "\n".join(lines)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for name, server in _session_servers.items():
        if name in getattr(item, "fixturenames", ()) and server.exit_code() is not None:
            item.user_properties.append((REPORT, f"{name} restarted before this test: it had exited "
                                                 f"with status {server.exit_code()}"))
            server.restart()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.failed:
        for name, server in _session_servers.items():
            if name in getattr(item, "fixturenames", ()) and server.exit_code() is not None:
                report.sections.append((f"{name} exited", _server_exit(name, server)))
    return report


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    """One real vLLM server (CPU) for the session, serving the tiny model as version 0; its
    environment comes from scripts/setup.sh (a missing one fails the test: never skipped).
    Tests that change its weights start from :func:`harness.checkpoints.fresh_server`."""
    # eager: no graph capture at start (12 s less on each start here; the same tokens/s on CPU)
    # 1024 tokens: room for a generation long enough that a weight update lands in its middle
    server = LocalVLLMServer(tmp_path_factory.mktemp("vllm"), tiny_model_dir(),
                             ServerLaunchConfig(max_model_len=1024, cuda_graphs=False))
    _session_servers["vllm_server"] = server
    server.start()
    _startup_lines.append(f"vLLM server started in {server.startup_seconds:.1f}s ({server.url}, {server.model})")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_keep_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalVLLMServer]:
    """A second real vLLM server for ``rollout.weight_update_mode: keep``, which needs a server
    that caches no prefixes across requests (started only by the tests that ask for it)."""
    server = LocalVLLMServer(tmp_path_factory.mktemp("vllm-keep"), tiny_model_dir(),
                             ServerLaunchConfig(max_model_len=1024, cuda_graphs=False, prefix_caching=False))
    _session_servers["vllm_keep_server"] = server
    server.start()
    _startup_lines.append(f"vLLM keep server started in {server.startup_seconds:.1f}s ({server.url})")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def services(dev_stack: DevStack) -> Services:
    """Addresses of the session's Kafka and Redis."""
    return dev_stack.services


@pytest.fixture(scope="session")
def kafka_bootstrap(services: Services) -> str:
    """The session broker's bootstrap address ("host:port")."""
    return services.kafka_bootstrap


@pytest.fixture(scope="session")
def redis_url(services: Services) -> str:
    """The session Redis as a redis:// URL."""
    return services.redis_url


@pytest.fixture
def unique_name() -> str:
    """A short name no other test uses: prefix topics, groups and Redis keys with it."""
    return "t" + uuid.uuid4().hex[:10]


@pytest_asyncio.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An asyncio Redis client on the session Redis; closed after the test, nothing flushed."""
    client = aioredis.from_url(redis_url)
    try:
        yield client
    finally:
        await client.aclose()


# How the suite is split over pytest-xdist's workers (`scripts/test.sh`: `-n 2`):
# - the tests that share nothing with the session's services (pure functions and classes, no
#   broker, no Redis, no subprocess timing): each is its own unit of work for any worker;
# - SIDE_LANE: tests that use the services but time nothing tightly against the machine's load
#   (tools on topics, Redis scripts, one tier at a time with generous deadlines; no vLLM server,
#   no torchrun, no lease expiry): one unit, run in order by one worker, with its own broker and
#   Redis, beside
# - every other test: one unit, run by the other worker in collection order as without xdist:
#   the fault and pipeline tests size their timeouts for one pipeline at a time on a 2-core
#   machine, so two of them never run at once.
PARALLEL_SAFE = ("tests/unit/", "tests/fuzz/test_decoders.py")
SIDE_LANE = tuple(f"tests/integration/test_{name}.py" for name in (
    "agent_endpoint", "budget_rebuild", "bundle", "debugging_tools", "dump_layout", "group_filter_pipeline",
    "group_trainer_version", "grouping_service", "harness_smoke", "namespace_install", "producer_images",
    "producer_service", "prompt_claims", "redis_budget", "redis_restored", "reference_workflow",
    "reward_service", "rollout_images", "security", "slot_releaser", "stream_without_ledger",
    "tier_health", "tiers_without_torch", "topic_checks", "trainer_stale", "trainer_stream",
    "trainer_versions", "transactional_core",
))
SERVICES = "services"
SIDE = "services beside"


def unit_of_work(nodeid: str) -> str:
    """The xdist scheduling unit of the test ``nodeid``."""
    if nodeid.startswith(PARALLEL_SAFE):
        return nodeid
    return SIDE if nodeid.startswith(SIDE_LANE) else SERVICES


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduler with :func:`unit_of_work` as the scope (its ``xdist_group``
    marks do not reach the scheduler under pytest 9.2, whose node ids are not ``_nodeid``)."""
    from xdist.scheduler import LoadScopeScheduling

    class ServicesInOrder(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return ServicesInOrder(config, log)


REPORT = "report"


@pytest.fixture
def show_report(record_property: Callable[[str, object], None]) -> ShowReport:
    """Show a text (a fault test's figures) in the session's summary, under the test's id:
    kept with the test's report, so it reaches the summary from an xdist worker too."""
    return lambda text: record_property(REPORT, text)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Show how long the session broker took to start (visible in plain `pytest` output; not
    from an xdist worker) and every test's ``show_report`` texts."""
    for line in _startup_lines:
        terminalreporter.write_line(line)
    shown = [(r.nodeid, value) for outcome in ("passed", "failed") for r in terminalreporter.stats.get(outcome, [])
             if r.when == "call" for name, value in r.user_properties if name == REPORT]
    if shown:
        terminalreporter.section("reports")
        for nodeid, text in shown:
            terminalreporter.write_line(f"{nodeid}:\n{text}\n")
