"""AReaL's own workflow classes run on rollstream unchanged (``areal`` 1.0.4 installed).

Each workflow is built exactly as an AReaL user builds it (AReaL's ``GenerationHyperparameters``,
a plain transformers tokenizer) or named in a worker's config, and run through
``rollstream.testing.check_workflow``: AReaL's ``RLVRWorkflow``, ``MultiTurnWorkflow``,
``VisionRLVRWorkflow`` and a user's subclass of AReaL's ``RolloutWorkflow``. Asserts what AReaL
code relies on: its request types are taken, its response fields are there, its workflow
context, stats tracker, reward wrapper and session tracing work, and the rows are standard.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from rollstream.areal.workflow import ArealWorkflow, areal_task_id
from rollstream.api.io_struct import ModelResponse
from rollstream.api.engine import InvalidRequestError
from rollstream.config import RolloutConfig, WorkflowSpec
from rollstream.engines.hf import HFEngine
from rollstream.imports import import_object
from rollstream.rollout_workers.registry import WorkflowRegistry
from rollstream.testing import ScriptedEngine, check_workflow, tiny_vlm_dir, workflow_processor  # noqa: F401 (tiny_vlm_dir: a fixture)
from tests.areal_pkg.rewards import answer_reward
from tests.reference_libs import import_reference

cli_args = import_reference("areal.api.cli_args")
areal_io = import_reference("areal.api.io_struct")
stats_tracker = import_reference("areal.utils.stats_tracker")
perf_tracer = import_reference("areal.utils.perf_tracer")
hf_utils = import_reference("areal.utils.hf_utils")
MultiTurnWorkflow = import_reference("areal.workflow.multi_turn").MultiTurnWorkflow
RLVRWorkflow = import_reference("areal.workflow.rlvr").RLVRWorkflow
VisionRLVRWorkflow = import_reference("areal.workflow.vision_rlvr").VisionRLVRWorkflow
UserWorkflow = import_reference("tests.areal_pkg.user_workflow").UserWorkflow

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
DATA = {"messages": MESSAGES, "answer": "4"}


@pytest.fixture
def tok(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))  # what AReaL's load_hf_tokenizer gives


@pytest.fixture
def areal_gconfig() -> Any:
    return cli_args.GenerationHyperparameters(max_new_tokens=8)


@pytest.fixture(autouse=True)
def fresh_stats() -> Iterator[None]:
    stats_tracker.export_all(reset=True)
    yield
    stats_tracker.export_all(reset=True)


def _answering(tok: Any, answer: str) -> ScriptedEngine:
    """Answers every call with ``answer``, then eos."""
    return ScriptedEngine([tok.encode(answer) + [tok.eos_token_id]], vocab_size=len(tok), tokenizer=tok)


def _prompt(tok: Any) -> list[int]:
    return hf_utils.apply_chat_template(tok, MESSAGES, tokenize=True, add_generation_prompt=True)


async def test_rlvr_built_as_areal_builds_it(tok: Any, areal_gconfig: Any) -> None:
    workflow = RLVRWorkflow(reward_fn=answer_reward, gconfig=areal_gconfig, tokenizer=tok)
    engine = _answering(tok, "4")
    check = await check_workflow(workflow, DATA, n=4, engine=engine)
    answer = tok.encode("4") + [tok.eos_token_id]
    for sample in check.samples:
        row = sample.tensors
        assert row is not None and row["input_ids"].tolist() == [_prompt(tok) + answer]
        assert row["loss_mask"].tolist() == [[0] * len(_prompt(tok)) + [1] * len(answer)]
        assert row["rewards"].tolist() == [1.0]  # AReaL's AsyncRewardWrapper scored it in its pool
    request = engine.requests[0]  # AReaL's ModelRequest, as the engine took it
    assert request.gconfig.max_new_tokens == 8 and tok.eos_token_id in request.gconfig.stop_token_ids
    assert stats_tracker.export_all() == {"rollout/reward": 1.0, "rollout/reward__count": 4}


async def test_rlvr_by_import_string_on_the_tiny_model(tok: Any, areal_gconfig: Any) -> None:
    check = await check_workflow("areal.workflow.rlvr:RLVRWorkflow", DATA, n=2,
                                 workflow_kwargs={"reward_fn": answer_reward, "gconfig": areal_gconfig, "tokenizer": tok})
    for sample in check.samples:
        (resp,) = sample.responses
        row = sample.tensors
        assert row is not None
        prompt = len(resp.input_tokens)
        assert row["logprobs"][0, prompt:].tolist() == resp.output_logprobs  # the engine's, not invented
        assert row["versions"][0].tolist() == [-1] * prompt + resp.output_versions


async def test_multi_turn_in_an_eval_episode(tok: Any, areal_gconfig: Any) -> None:
    workflow = MultiTurnWorkflow(reward_fn=answer_reward, gconfig=areal_gconfig, tokenizer=tok, max_turns=2,
                                 turn_discount=0.5)
    wrong, right = tok.encode("5") + [tok.eos_token_id], tok.encode("4") + [tok.eos_token_id]
    first_turn = len(_prompt(tok))
    engine = ScriptedEngine(lambda req: wrong if len(req.input_ids) == first_turn else right, vocab_size=len(tok))
    check = await check_workflow(workflow, DATA, n=2, engine=engine, is_eval=True)
    for sample in check.samples:
        row = sample.tensors
        assert row is not None and row["rewards"].tolist() == [0.5]  # right at the second turn, discounted
        ids = row["input_ids"][0].tolist()
        retry = workflow.multi_turn_prompt_ids
        assert ids == _prompt(tok) + wrong + retry + right
        assert row["loss_mask"][0].tolist() == [0] * len(_prompt(tok)) + [1] * len(wrong) + [0] * len(retry) + [1] * len(right)
    stats = stats_tracker.export_all()
    assert stats["eval-rollout/reward"] == 0.5 and stats["eval-rollout/num_turns"] == 2.0  # AReaL's eval scope
    assert not any(key.startswith("rollout/") for key in stats)


async def test_vision_rlvr_gets_pil_images_and_sends_them(tiny_vlm_dir: Path) -> None:
    from PIL import Image

    processor = workflow_processor(tiny_vlm_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_vlm_dir))
    workflow = VisionRLVRWorkflow(reward_fn=answer_reward, gconfig=cli_args.GenerationHyperparameters(max_new_tokens=4),
                                  tokenizer=tokenizer, processor=processor, enable_thinking=False)
    png = io.BytesIO()
    Image.new("RGB", (40, 40), "red").save(png, format="PNG")
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}],
                                         add_generation_prompt=True, tokenize=False)
    engine = HFEngine(str(tiny_vlm_dir), seed=0)
    await engine.start()
    try:  # the row as the producer publishes it: the image as an encoded file
        check = await check_workflow(workflow, {"messages": text, "images": [png.getvalue()], "answer": "1"}, n=2, engine=engine)
    finally:
        await engine.close()
    for sample in check.samples:
        (resp,) = sample.responses
        assert len(resp.input_images) == 1 and resp.processor is processor  # AReaL's response fields
        row = sample.tensors
        assert row is not None and row["mm_token_type_ids"].shape == row["input_ids"].shape
        assert row["input_ids"][0].tolist() == resp.input_tokens + resp.output_tokens
        assert "multi_modal_input" not in row  # rebuilt on the trainer side from the images the engine saw


@pytest.fixture
def session_trace(tmp_path: Path) -> Iterator[Path]:
    perf_tracer.reset()
    config = cli_args.PerfTracerConfig(experiment_name="e", trial_name="t", fileroot=str(tmp_path), enabled=False,
                                       session_tracer=cli_args.SessionTracerConfig(enabled=True, flush_threshold=1))
    perf_tracer.configure(config, rank=0)
    try:
        yield tmp_path
    finally:
        perf_tracer.reset()


def _sessions(root: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(root.rglob("sessions-r0.jsonl")) for line in f.read_text().splitlines()]


async def test_a_users_subclass_sees_areal_context_stats_and_tracing(tok: Any, areal_gconfig: Any, session_trace: Path) -> None:
    workflow = UserWorkflow(areal_gconfig, tok, answer_reward)
    check = await check_workflow(workflow, DATA, n=3, engine=_answering(tok, "4"), is_eval=True)
    assert len(check.episodes) == 3
    assert sorted(workflow.seen) == sorted((True, areal_task_id("check-0", i), "eval-rollout") for i in range(3))
    assert stats_tracker.export_all() == {"eval-rollout/reward": 1.0, "eval-rollout/reward__count": 3,
                                          "eval-rollout/end_with_stop": 1.0, "eval-rollout/end_with_stop__count": 3}
    sessions = _sessions(session_trace)
    assert sorted(s["task_id"] for s in sessions) == sorted(areal_task_id("check-0", i) for i in range(3))
    for session in sessions:  # finalized as AReaL's executor finalizes, with both phases traced
        assert session["status"] == "accepted" and session["finalized_ts"] is not None
        assert len(session["phases"]["generate"]) == 1 and len(session["phases"]["reward"]) == 1


async def test_rejected_and_failed_episodes_end_as_areal_records_them(tok: Any, areal_gconfig: Any, session_trace: Path) -> None:
    workflow = UserWorkflow(areal_gconfig, tok, answer_reward)
    rejected = await check_workflow(workflow, {**DATA, "reject_all": True}, n=2, engine=_answering(tok, "4"))
    failed = await check_workflow(workflow, {**DATA, "fail_all": True}, n=2, engine=_answering(tok, "4"), allow_failures=True)
    assert [s.outcome for s in rejected.samples] == ["rejected"] * 2
    assert [s.error for s in failed.samples] == ["RuntimeError: the user's workflow failed on purpose"] * 2
    ended = sorted((s["status"], s["reason"]) for s in _sessions(session_trace))
    assert ended == [("failed", "workflow_exception")] * 2 + [("rejected", "returned_none")] * 2
    assert [seen[2] for seen in workflow.seen] == ["rollout"] * 4


async def test_areal_requests_are_taken_and_answered_with_areal_response_fields(tok: Any, tiny_model_dir: Path) -> None:
    engine = HFEngine(str(tiny_model_dir), seed=0)
    await engine.start()
    try:
        gconfig = cli_args.GenerationHyperparameters(max_new_tokens=4, greedy=True).new_with_stop_and_pad_token_ids(tok)
        req = areal_io.ModelRequest(input_ids=_prompt(tok), gconfig=gconfig, tokenizer=tok)
        resp = await engine.agenerate(req)
        for bad, needle in ((gconfig.new(n_samples=2), "n_samples is 2"), (gconfig.new(use_beam_search=True), "beam search")):
            with pytest.raises(InvalidRequestError, match=needle):
                await engine.agenerate(areal_io.ModelRequest(input_ids=_prompt(tok), gconfig=bad, tokenizer=tok))
    finally:
        await engine.close()
    assert resp.tokenizer is tok and resp.input_tokens == _prompt(tok) and 0 < resp.output_len <= 4
    theirs = {f.name for f in dataclasses.fields(areal_io.ModelResponse)}
    assert theirs <= {f.name for f in dataclasses.fields(ModelResponse)}
    same = areal_io.ModelResponse(**{name: getattr(resp, name) for name in theirs})
    for prop in ("input_len", "output_len", "end_with_stop"):
        assert getattr(resp, prop) == getattr(same, prop), prop


@pytest.mark.parametrize(("tokens", "reason"), [([5, 0, 0], "stop"), ([5, 6], "length"), ([5, 6], "stop"), ([0], "stop"), ([], "stop")])
def test_output_without_stop_answers_as_areal(tokens: list[int], reason: str, tok: Any) -> None:
    ours = ModelResponse(output_tokens=tokens, stop_reason=reason, tokenizer=tok)  # type: ignore[arg-type]
    theirs = areal_io.ModelResponse(output_tokens=tokens, stop_reason=reason, tokenizer=tok)
    assert ours.end_with_stop == theirs.end_with_stop
    try:
        expected: Any = theirs.output_tokens_without_stop
    except ValueError:
        with pytest.raises(ValueError):
            ours.output_tokens_without_stop  # noqa: B018
    else:
        assert ours.output_tokens_without_stop == expected


def test_a_workers_config_names_areal_classes_and_gets_areal_settings(tok: Any) -> None:
    rlvr = WorkflowSpec(path="areal.workflow.rlvr:RLVRWorkflow", kwargs={
        "reward_fn": "tests.areal_pkg.rewards.answer_reward", "gconfig": "$gconfig", "tokenizer": "$tokenizer"})
    user = WorkflowSpec(path="tests.areal_pkg.user_workflow.UserWorkflow", kwargs={
        "reward_fn": "tests.areal_pkg.rewards.answer_reward", "gconfig": "$gconfig", "tokenizer": "$tokenizer"})
    registry = WorkflowRegistry.from_config(
        RolloutConfig(workflows={"areal_rlvr": rlvr, "user": user}, gconfig={"max_new_tokens": 6}), tok)
    for key, cls in (("areal_rlvr", RLVRWorkflow), ("user", UserWorkflow)):
        workflow = registry.resolve(key)
        assert isinstance(workflow, ArealWorkflow) and isinstance(workflow.workflow, cls)
        assert type(workflow.workflow.gconfig) is cli_args.GenerationHyperparameters  # what the class expects
        assert workflow.workflow.gconfig.max_new_tokens == 6 and tok.eos_token_id in workflow.workflow.gconfig.stop_token_ids
        assert workflow.workflow.tokenizer is tok and type(tok).__module__.startswith("transformers.")


def test_rollstream_log_lines_survive_areal_replacing_the_logger_hierarchy(caplog: pytest.LogCaptureFixture) -> None:
    areal_logging = import_reference("areal.utils.logging")
    caplog.set_level(logging.INFO)
    areal_logging.getLogger("SomeAReaLModule")  # what every AReaL module does when it is imported
    logging.getLogger("rollstream.test.before_restore").info("lost")
    assert "lost" not in caplog.text  # detached from the standard root, and so from every handler on it
    import_object("areal.workflow.rlvr:RLVRWorkflow")  # a config-named import puts the standard one back
    logging.getLogger("rollstream.test.after_restore").info("kept")
    assert "kept" in caplog.text


def test_importing_areal_leaves_the_processs_event_loop_policy_as_it_was() -> None:
    """``areal.api.cli_args`` calls ``uvloop.install()`` when imported; rollstream puts the
    process's own policy back (an idle uvloop loop runs no Python signal handler, so alarms and
    SIGALRM timeouts would never fire). A fresh interpreter: AReaL is imported only once per process."""
    code = (
        "import asyncio\n"
        "from rollstream.imports import import_object\n"
        "import_object('areal.workflow.rlvr:RLVRWorkflow')\n"
        "import uvloop\n"
        "print(type(asyncio.get_event_loop_policy()).__module__, isinstance(asyncio.new_event_loop(), uvloop.Loop))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["asyncio.unix_events", "False"], out.stdout
