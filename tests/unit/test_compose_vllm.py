"""The compose ``vllm`` service (profile ``cpu``): started exactly as rollstream starts a vLLM
server (``rollstream.dev.vllm_server``), serving the demo model that ``demo-assets`` writes, on
the volume where the trainer's checkpoints are, and the CPU rollout workers pointed at it.

The health check is run as written against a stand-in server that answers ``/health``, then
against none.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.compose import ROOT, load_compose
from harness.services import free_port
from rollstream.config import load_config
from rollstream.config import ServerLaunchConfig
from rollstream.dev.vllm_server import SERVER_ENV, server_argv


pytestmark = pytest.mark.timeout(60)


def vllm(env: dict[str, str] | None = None) -> dict:
    return load_compose(env)["services"]["vllm"]


def test_the_server_starts_as_rollstream_starts_one() -> None:
    service = vllm()
    cpu = ServerLaunchConfig(device="cpu")
    assert service["command"] == server_argv("python", "/data/demo/model", 8000, cpu, host="0.0.0.0")
    assert {k: str(v) for k, v in service["environment"].items()} == SERVER_ENV
    other = vllm({"VLLM_MODEL": "/data/models/mine", "VLLM_SERVED_MODEL_NAME": "mine"})["command"]
    assert other == server_argv("python", "/data/models/mine", 8000, cpu, host="0.0.0.0", served_name="mine")


def test_the_launch_settings_come_from_the_environment() -> None:
    """rollout.launch's dtype, context and batch, as compose's variables."""
    command = vllm({"VLLM_DTYPE": "bfloat16", "VLLM_MAX_MODEL_LEN": "2048", "VLLM_MAX_NUM_SEQS": "64",
                    "VLLM_PREFIX_CACHING": "--no-enable-prefix-caching"})["command"]
    launch = ServerLaunchConfig(device="cpu", dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
                                prefix_caching=False)
    assert [str(part) for part in command] == server_argv("python", "/data/demo/model", 8000, launch, host="0.0.0.0")


def test_it_serves_the_demo_model_where_the_trainer_writes_its_checkpoints() -> None:
    services = load_compose({"ROLLSTREAM_CONFIG": "rollstream-cpu.yaml"})["services"]
    server = services["vllm"]
    assert server["depends_on"] == {"demo-assets": {"condition": "service_completed_successfully"}}
    assert "rollstream-data:/data" in server["volumes"]
    assert "rollstream-data:/data" in services["trainer"]["volumes"]
    config = load_config(ROOT / "deploy" / "rollstream-cpu.yaml")
    model = server["command"][server["command"].index("--model") + 1]
    assert model == config.rollout.model_path == config.trainer.model_path  # one model, its tokenizer
    assert config.trainer.checkpoint_dir.startswith("/data/")  # the server loads them at the same path
    assert int(server["shm_size"].rstrip("gb")) >= 1  # its processes share 160 MiB; Docker gives 64 MiB


def test_the_cpu_rollout_workers_generate_on_it_once_it_is_healthy() -> None:
    services = load_compose({"ROLLSTREAM_CONFIG": "rollstream-cpu.yaml"})["services"]
    worker = services["rollout-worker-cpu"]
    assert worker["depends_on"]["vllm"] == {"condition": "service_healthy"}
    port = services["vllm"]["command"][services["vllm"]["command"].index("--port") + 1]
    environ = {k: str(v) for k, v in worker["environment"].items()}
    config = load_config(ROOT / "deploy" / "rollstream-cpu.yaml", environ=environ)
    assert config.rollout.engine == "vllm" and config.rollout.server_urls == [f"http://vllm:{port}"]
    assert services["vllm"]["profiles"] == worker["profiles"] == ["cpu"]


@pytest.fixture
def health_server() -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_health_check_follows_the_servers_health(health_server: int) -> None:
    test = vllm()["healthcheck"]["test"]
    assert test[0] == "CMD"

    def check(port: int) -> int:
        argv = [part.replace("localhost:8000", f"127.0.0.1:{port}") for part in test[1:]]
        return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode

    assert check(health_server) == 0
    assert check(free_port()) != 0
