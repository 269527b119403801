"""``rollstream demo``: services, tiny model, config, tier processes, trainer, report.

Order of a run (everything under ``run_dir``):

1. the tiny model is built and warmed up (``model/``, version 0) in a thread while the local
   Kafka broker and redis-server start (or ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` are used);
2. the dataset (``dataset.jsonl``) and the one config file (``config.yaml``) are written and
   the trial's topics created;
3. producer, rollout worker(s), reward worker, grouping and dump start as subprocesses
   (``logs/<name>.log``), and the example GRPO trainer (``examples/grpo_trainer.py``, under
   ``torchrun``, which restarts it up to ``trainer_restarts`` times) for ``steps`` steps, publishing a version per step
   (``ckpt/v<n>``) and appending one line per step to ``steps.jsonl``, which the live view
   follows;
4. every child is stopped (SIGTERM, then SIGKILL after a grace period), then the services;
   ``reward_per_step.png`` and the summary are written.

A first Ctrl-C / SIGTERM stops the trainer after its current step and still cleans up; a
second one stops waiting for it (the cleanup still runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from rollstream.runtime.tasks import cancel_and_wait, wait_event
from rollstream.config import RollstreamConfig, load_config
from rollstream.demo.agent import child_env as agent_child_env, prepare_agent_model, with_agent
from rollstream.demo.children import ChildGroup, tier_argv
from rollstream.demo.example_trainer import TORCHRUN_ENV, trainer_argv
from rollstream.demo.progress import DemoProgress, LagProbe, ProgressView
from rollstream.demo.report import StepsFile, plot_rewards, weight_reloads
from rollstream.demo.settings import DemoSettings, demo_config_tree, demo_launch, write_config
from rollstream.demo.task import dataset_rows, write_dataset
from rollstream.dev.launcher import DevStack, dev_stack
from rollstream.dev.vllm_server import LocalVLLMServer
from rollstream.kafka.admin import ensure_topics
from rollstream.kafka.topics import TopicNames

log = logging.getLogger(__name__)

WATCH_SECONDS = 2.0
FOLLOW_SECONDS = 0.5  # how often the steps file is read
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **TORCHRUN_ENV}


@dataclass(frozen=True)
class DemoOptions:
    settings: DemoSettings
    run_dir: Path
    live: bool = True
    timeout_seconds: float = 900.0  # the whole run, services and model included
    stop_grace_seconds: float = 20.0
    agent: bool = False  # the example agent (rollstream.demo.agent) instead of the RLVR workflow


@dataclass
class DemoResult:
    """What a run did; ``reason`` is done | interrupted | timeout | ``tier failed: ...`` |
    ``failed: ...``."""

    run_dir: Path
    reason: str = "interrupted"
    reports: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    reloads: list[int] = field(default_factory=list)
    plot: Path | None = None
    config_path: Path | None = None

    @property
    def rewards(self) -> list[float]:
        return [r.reward_mean for r in self.reports]


def default_run_dir() -> Path:
    return Path("runs") / "demo" / time.strftime("%Y%m%d-%H%M%S")


def experiment_name(run_dir: Path) -> str:
    return "demo-" + re.sub(r"[^A-Za-z0-9-]", "-", run_dir.resolve().name)


@contextlib.contextmanager
def _file_logging(path: Path) -> Iterator[None]:
    """This process's logs go to ``path``; the terminal belongs to the live view."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()


def _quiet_transformers() -> None:
    """No download/save progress bars between the demo's own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_demo(options: DemoOptions, console: Console) -> DemoResult:
    """Run the whole demo; returns its result (the caller prints it)."""
    _quiet_transformers()
    run_dir = options.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    result = DemoResult(run_dir)
    started = time.monotonic()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # cleans up like Ctrl-C
    try:
        with _file_logging(run_dir / "demo.log"):
            try:
                _run(options, run_dir, result, console, started)
            except Exception as exc:  # everything started is stopped by now
                log.exception("demo failed")
                result.reason = f"failed: {type(exc).__name__}: {exc} (traceback in {run_dir / 'demo.log'})"
    except (KeyboardInterrupt, asyncio.CancelledError):
        result.reason = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, previous)
        result.seconds = time.monotonic() - started
        result.reloads = weight_reloads(sorted((run_dir / "logs").glob("rollout-*.log")))
        if result.reports:
            result.plot = plot_rewards(run_dir / "reward_per_step.png", result.rewards,
                                       f"rollstream demo {run_dir.name}: reward per step")
    return result


def _run(options: DemoOptions, run_dir: Path, result: DemoResult, console: Console, started: float) -> None:
    settings = options.settings
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="demo-model")
    try:
        console.print(f"[bold]rollstream demo[/bold]: run directory {run_dir}")
        model_future = executor.submit(_prepare_model, settings, run_dir / "model", options.agent)
        console.print("building the tiny model and warming it up; starting Kafka and Redis ...")
        with dev_stack(run_dir / "services") as stack, contextlib.ExitStack() as servers:
            services = stack.services
            console.print(f"services: kafka {services.kafka_bootstrap}, redis {services.redis_url} ({services.source})")
            model = model_future.result()
            console.print(f"model ready: {model.parameters:,} parameters, warm-up loss {model.warmup_loss:.3f}")
            server = (servers.enter_context(_inference_server(settings, model.path, run_dir, console))
                      if settings.engine == "vllm" else None)
            dataset = write_demo_dataset(settings, run_dir)
            tree = demo_config_tree(
                settings, kafka_bootstrap=services.kafka_bootstrap, redis_url=services.redis_url,
                experiment=experiment_name(run_dir), run_dir=run_dir, model_dir=model.path, dataset=dataset,
                server_urls=[server.url] if server else None,
            )
            if options.agent:
                tree = with_agent(tree)
            result.config_path = write_config(tree, run_dir / "config.yaml")
            config = load_config(result.config_path)
            deadline = started + options.timeout_seconds
            children = ChildGroup(run_dir / "logs", env={**CHILD_ENV, **(agent_child_env() if options.agent else {})})
            try:
                _start_tiers(children, settings, result.config_path, config)
                children.start("trainer", trainer_argv(result.config_path, settings.trainer_ranks, run_dir / "steps.jsonl",
                                                       max_restarts=config.trainer.max_restarts))
                _write_processes(run_dir / "processes.json", stack, children, server)
                asyncio.run(_pipeline(config, children, options, result, console, deadline))
            finally:
                console.print("stopping the tiers ...")
                previous = signal.signal(signal.SIGINT, lambda *_: children.kill_all())
                try:
                    result.exit_codes = children.stop_all(options.stop_grace_seconds)
                finally:
                    signal.signal(signal.SIGINT, previous)
            console.print("stopping the services ...")
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


def write_demo_dataset(settings: DemoSettings, run_dir: Path) -> Path:
    rows = dataset_rows(settings.dataset_size(), settings.seed + 1, settings.max_operand)
    return write_dataset(run_dir / "dataset.jsonl", rows)


def prepare_only(settings: DemoSettings, run_dir: Path, console: Console, agent: bool = False) -> None:
    """Write the warmed-up model (``model/``) and the dataset, nothing else (the compose
    deployment's one-shot ``demo-assets`` service). Both are kept when already there."""
    _quiet_transformers()
    model_dir, dataset = run_dir / "model", run_dir / "dataset.jsonl"
    if (model_dir / "config.json").is_file() and dataset.is_file():
        console.print(f"demo assets already in {run_dir}")
        return
    model = _prepare_model(settings, model_dir, agent)
    write_demo_dataset(settings, run_dir)
    console.print(f"demo model ({model.parameters:,} parameters) in {model_dir}; dataset in {dataset}")


@contextlib.contextmanager
def _inference_server(settings: DemoSettings, model: Path, run_dir: Path, console: Console) -> Iterator[LocalVLLMServer]:
    """``--engine vllm``: a local vLLM server on the warmed-up model (version 0), stopped at the end
    (with ``hf``, the rollout workers run the model themselves)."""
    server = LocalVLLMServer(run_dir / "vllm", model, demo_launch(settings), cpus="0")
    console.print("starting the vLLM server (30-60 s on CPU) ...")
    server.start()
    console.print(f"vLLM server ready in {server.startup_seconds:.0f}s at {server.url} (log {server.log_path})")
    try:
        yield server
    finally:
        console.print("stopping the vLLM server ...")
        server.stop()


def _write_processes(path: Path, stack: DevStack, children: ChildGroup, server: LocalVLLMServer | None) -> None:
    """Pids of everything this run started (for operators, and for the test that checks that
    none survives the run)."""
    services = {name: proc.pid for name, proc in (("kafka", stack.broker), ("redis", stack.redis), ("vllm", server))
                if proc is not None}
    record = {"children": {c.name: c.pid for c in children.children}, "services": services}
    path.write_text(json.dumps(record, indent=2) + "\n")


def _prepare_model(settings: DemoSettings, out_dir: Path, agent: bool = False) -> Any:
    import torch

    from rollstream.demo.model import prepare_model

    torch.set_num_threads(1)  # the broker starts meanwhile; 2 cores are all we have
    prepare = prepare_agent_model if agent else prepare_model
    return prepare(out_dir, warmup_steps=settings.warmup_steps, hidden_size=settings.hidden_size,
                   num_layers=settings.num_layers, seed=settings.seed)


def _start_tiers(children: ChildGroup, settings: DemoSettings, config_path: Path, config: RollstreamConfig) -> None:
    asyncio.run(ensure_topics(config.kafka, TopicNames.of(config)))
    for tier in ("reward-worker", "grouping", "dump", "producer"):
        children.start(tier, tier_argv(tier, config_path))
    for index in range(settings.workers):
        children.start(f"rollout-{index}", tier_argv("rollout-worker", config_path, [f"rollout.worker_id=demo-rollout-{index}"]))


async def _pipeline(config: RollstreamConfig, children: ChildGroup, options: DemoOptions, result: DemoResult,
                    console: Console, deadline: float) -> None:
    stop = asyncio.Event()
    _install_signals(stop)
    progress = DemoProgress(options.settings.steps)
    steps = StepsFile(result.run_dir / "steps.jsonl")
    trainer = next(c for c in children.children if c.name == "trainer")
    with ProgressView(progress, console, options.live) as view:
        def follow() -> None:
            for record in steps.new_records():
                progress.add_step(record)
                result.reports.append(record)
                view.refresh(step_done=True)

        watcher = asyncio.create_task(_watch(config, children, progress, view, result, stop, deadline))
        try:
            while trainer.is_running() and not stop.is_set():
                follow()
                await wait_event(stop, FOLLOW_SECONDS)
            if trainer.is_running():  # stopped early: the trainer finishes its step first (bounded)
                trainer.terminate()
                give_up = time.monotonic() + options.stop_grace_seconds
                while trainer.is_running() and time.monotonic() < give_up:
                    follow()
                    await asyncio.sleep(FOLLOW_SECONDS)
            follow()
            if trainer.exit_code() not in (None, 0) and not stop.is_set():
                result.reason = f"tier failed: trainer (see {trainer.log_path})"
        finally:
            await cancel_and_wait(watcher)
    if len(result.reports) >= options.settings.steps:
        result.reason = "done"


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    count = 0

    def on_signal() -> None:
        nonlocal count
        count += 1
        if count == 1:
            stop.set()  # finish the current step, then clean up
        elif main is not None:
            main.cancel()  # do not wait for the step; cleanup still runs

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


async def _watch(config: RollstreamConfig, children: ChildGroup, progress: DemoProgress, view: ProgressView,
                 result: DemoResult, stop: asyncio.Event, deadline: float) -> None:
    """Every few seconds: lags, a crashed tier (stops the run), the deadline (stops the run)."""
    async with LagProbe(config) as probe:
        while not stop.is_set():
            failed = children.failed()
            if failed:
                result.reason = f"tier failed: {failed[0].name} (see {failed[0].log_path})"
                stop.set()
            elif time.monotonic() > deadline:
                result.reason = "timeout"
                stop.set()
            with contextlib.suppress(Exception):  # lag is for display only
                progress.lags = await asyncio.wait_for(probe.lags(), WATCH_SECONDS * 2)
            view.refresh()
            await wait_event(stop, WATCH_SECONDS)
