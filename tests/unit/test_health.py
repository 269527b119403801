"""The health server: readiness follows what the tier says, liveness follows its event loop
(a loop blocked past the limit fails /livez while the server thread still answers)."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from harness.health_server import serving
from rollstream.runtime.health import Health, heartbeat, heartbeat_thread, serve_health
import rollstream.runtime.metrics


pytestmark = pytest.mark.timeout(60)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.fixture
def served() -> Iterator[tuple[Health, int]]:
    health = Health(liveness_timeout=1.0)
    with serving(health) as port:
        yield health, port


def test_readiness_is_what_the_tier_says(served: tuple[Health, int]) -> None:
    health, port = served
    assert get(port, "/readyz") == (503, "starting\n")
    health.mark_ready()
    assert get(port, "/readyz") == (200, "ok\n")
    health.mark_not_ready("stopping")
    assert get(port, "/readyz") == (503, "stopping\n")


async def test_liveness_fails_while_the_event_loop_is_blocked_and_recovers(served: tuple[Health, int]) -> None:
    health, port = served
    beating = asyncio.create_task(heartbeat(health, interval=0.1))
    try:
        await asyncio.sleep(0.3)
        assert (await asyncio.to_thread(get, port, "/livez"))[0] == 200
        probe = asyncio.get_running_loop().run_in_executor(None, lambda: (time.sleep(1.6), get(port, "/livez"))[1])
        time.sleep(2.0)  # the loop is stuck: no heartbeat for 2 s (limit 1 s)
        status, body = await probe
        assert status == 503 and "event loop stuck" in body
        await asyncio.sleep(0.3)
        assert (await asyncio.to_thread(get, port, "/livez"))[0] == 200
    finally:
        beating.cancel()


def test_metrics_are_served_beside_the_probes(served: tuple[Health, int]) -> None:
    _, port = served
    status, body = get(port, "/metrics")
    assert status == 200 and "rollstream_messages_in_total" in body
    assert get(port, "/nothing")[0] == 404


def test_no_port_no_server() -> None:
    assert serve_health(None) is None


def test_a_heartbeat_thread_keeps_a_process_without_an_event_loop_live(served: tuple[Health, int]) -> None:
    health, port = served
    health.liveness_timeout = 0.3
    stop = heartbeat_thread(health, interval=0.05)
    time.sleep(0.5)
    assert get(port, "/livez")[0] == 200
    stop.set()
    time.sleep(0.5)
    assert get(port, "/livez")[0] == 503  # no more beats: as a stuck loop
