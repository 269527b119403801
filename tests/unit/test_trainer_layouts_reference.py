"""to_verl and to_areal against the real libraries (verl 0.9.1, areal 1.0.4; never mocked).

A batch from ``rollstream.trainer`` (three groups of four rows: prompts of two lengths, one
multi-turn row whose retry prompt sits inside the response, one group with equal rewards):

* ``to_verl(batch).to_dataproto()`` is a real ``verl.DataProto``; verl's own GRPO outcome
  advantage reads its ``token_level_rewards``, ``response_mask`` and ``uid``; a forward pass of
  the tiny model on verl's LEFT-padded layout (``position_ids`` included) gives the logprobs of
  the right-padded one; verl's vanilla policy loss on them equals the example trainer's
  ``clipped_policy_loss``.
* ``to_areal(batch)`` goes through AReaL's ``Normalization`` (the actor's reward normalisation:
  group mean and std), its micro-batch split, its ``pack_tensor_dict`` (equal to
  ``to_areal(batch, packed=True)``) and its actor loss ``ppo_actor_loss_fn``, with the actor's
  shift of logprobs and loss mask by one position; advantages and loss equal the example
  trainer's.

Where they cannot agree (verl's Bessel-corrected std), the test pins the exact relation;
docs/TRAINER.md#layouts says why.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.group_rows import group, row
from rollstream.trainer import TrainingStep, assemble, to_areal, to_verl
from rollstream.trainer.grpo import clipped_policy_loss, group_advantages, token_logprobs
from tests.reference_libs import import_reference


verl = import_reference("verl")
core_algos = import_reference("verl.trainer.ppo.core_algos")
verl_functional = import_reference("verl.utils.torch_functional")
verl_config = import_reference("verl.workers.config")
areal_data = import_reference("areal.utils.data")
areal_functional = import_reference("areal.utils.functional")
cli_args = import_reference("areal.api.cli_args")

GROUP = 4
CLIP = 0.2


def _group(task: str, rewards: list[float], generator: torch.Generator) -> object:
    rows = []
    for i, reward in enumerate(rewards):
        prompt = torch.randint(3, 300, (3 + i % 2,), generator=generator).tolist()
        out = torch.randint(3, 300, (2 + i,), generator=generator).tolist()
        turns = [(out, True)] if i != 1 else [(out[:1], True), ([7, 8], False), (out[1:], True)]  # a retry prompt inside
        rows.append(row(prompt, turns, version=2, reward=reward))
    return group(task, rows)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()


def _forward(model: torch.nn.Module, batch: TrainingStep) -> torch.Tensor:
    """The example trainer's forward: right-padded rows, logprob of token t at position t."""
    t = batch.tensors
    with torch.no_grad():
        logits = model(input_ids=t["input_ids"].long(), attention_mask=t["attention_mask"].long()).logits
    return token_logprobs(logits, t["input_ids"])


@pytest.fixture(scope="module")
def batch(model: torch.nn.Module) -> TrainingStep:
    """Three groups; behaviour logprobs near the model's (noise of std 0.4), so some ratios are
    clipped and most are not, as after a training step."""
    generator = torch.Generator().manual_seed(0)
    batch = assemble([_group("a", [1.0, 0.0, 0.5, 0.25], generator), _group("b", [0.0, 0.0, 1.0, 1.0], generator),
                      _group("c", [0.5] * GROUP, generator)])
    mask = batch.tensors["loss_mask"].bool()
    noise = torch.randn(mask.shape, generator=generator) * 0.4
    batch.tensors["logprobs"] = torch.where(mask, _forward(model, batch) + noise, 0.0)
    return batch


@pytest.fixture(scope="module")
def new_logprobs(batch: TrainingStep, model: torch.nn.Module) -> torch.Tensor:
    return _forward(model, batch)


def _example_loss(batch: TrainingStep, new: torch.Tensor, advantages: torch.Tensor) -> tuple[float, float]:
    """The example trainer's loss and clipped share of loss tokens."""
    loss, stats = clipped_policy_loss(new, batch.tensors["logprobs"], advantages, batch.tensors["loss_mask"], CLIP)
    assert 0.05 < stats.clip_fraction < 0.95, stats  # both sides of the clip are exercised
    return float(loss), stats.clip_fraction


def test_to_verl_is_a_dataproto_verl_trains_on(batch: TrainingStep, model: torch.nn.Module, new_logprobs: torch.Tensor) -> None:
    data = to_verl(batch).to_dataproto()
    assert isinstance(data, verl.DataProto) and len(data) == 12
    data.check_consistency()
    halves = data.chunk(2)  # verl's own batch operations work on it
    assert verl.DataProto.concat(halves).non_tensor_batch["uid"].tolist() == data.non_tensor_batch["uid"].tolist()

    grpo = core_algos.get_adv_estimator_fn(core_algos.AdvantageEstimator.GRPO)
    advantages, _ = grpo(token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
                         index=data.non_tensor_batch["uid"])
    response = data.batch["response_mask"].bool()
    ours = group_advantages(batch.tensors["rewards"], batch.row_task)
    for r in range(len(data)):  # one value per row, on its response tokens only
        assert torch.all(advantages[r][~response[r]] == 0)
        # verl normalises by the Bessel-corrected std (n - 1), the example trainer by the
        # population std (n): for a group of n rows verl's is sqrt((n - 1) / n) times ours
        expected = float(ours[r]) * math.sqrt((GROUP - 1) / GROUP)
        torch.testing.assert_close(advantages[r][response[r]], torch.full((int(response[r].sum()),), expected), atol=1e-5, rtol=0)

    # verl's forward on its own layout: left-padded prompts, position_ids, the response slice
    width = data.batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"],
                       position_ids=data.batch["position_ids"]).logits
    log_prob = verl_functional.logprobs_from_logits(logits[:, -width - 1 : -1, :], data.batch["responses"])
    shared = torch.stack([ours[r] * response[r] for r in range(len(data))])  # one advantage for both losses
    config = verl_config.ActorConfig(strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1,
                                     rollout_n=GROUP, clip_ratio=CLIP)
    loss, metrics = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=data.batch["old_log_probs"], log_prob=log_prob, advantages=shared,
        response_mask=data.batch["response_mask"], loss_agg_mode="token-mean", config=config)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0  # no ratio reached verl's dual clip (3.0)
    example, clipped = _example_loss(batch, new_logprobs, ours)
    assert math.isclose(float(loss), example, abs_tol=1e-6)
    assert math.isclose(metrics["actor/pg_clipfrac"], clipped, abs_tol=1e-6)


def test_to_areal_through_areals_batch_utilities_and_actor_loss(batch: TrainingStep, new_logprobs: torch.Tensor) -> None:
    data = to_areal(batch)
    packed = areal_data.pack_tensor_dict(to_areal(batch))
    ours_packed = to_areal(batch, packed=True)
    assert sorted(packed) == sorted(ours_packed)
    for key, value in packed.items():
        assert torch.equal(value, ours_packed[key]) if torch.is_tensor(value) else value == ours_packed[key], key
    parts = areal_data.split_padded_tensor_dict_into_mb_list(data, cli_args.MicroBatchSpec(n_mbs=2))
    assert sum(mb["input_ids"].shape[0] for mb in parts.mbs) == 12

    # GRPO as AReaL's actor configures it: rewards normalised per group (population std, the
    # example trainer's eps), then every loss token of a row carries its row's value
    norm = areal_data.Normalization(cli_args.NormConfig(mean_level="group", std_level="group", group_size=GROUP,
                                                        std_unbiased=False, eps=1e-6))
    rewards = norm(data["rewards"].clone())
    ours = group_advantages(batch.tensors["rewards"], batch.row_task)
    torch.testing.assert_close(rewards, ours, atol=1e-6, rtol=0)

    # The actor shifts logprobs and loss mask by one (position t: the logprob of token t + 1,
    # where the logits of position t predict it) before its loss
    loss_mask = torch.roll(data["loss_mask"], -1, -1).bool()
    old = torch.roll(data["logprobs"], -1, -1)
    loss, stat = areal_functional.ppo_actor_loss_fn(
        logprobs=torch.roll(new_logprobs, -1, -1), proximal_logprobs=old, old_logprobs=old,
        advantages=rewards.unsqueeze(1) * loss_mask, eps_clip=CLIP, loss_mask=loss_mask)
    example, clipped = _example_loss(batch, new_logprobs, ours)
    assert math.isclose(float(loss), example, abs_tol=1e-6)
    assert math.isclose(int(stat["clip_mask"].sum()) / int(loss_mask.sum()), clipped, abs_tol=1e-6)


def test_areal_group_normalisation_needs_full_groups() -> None:
    """Why to_areal leaves advantages to the trainer when groups lost samples (docs/TRAINER.md)."""
    generator = torch.Generator().manual_seed(1)
    short = assemble([_group("a", [1.0, 0.0, 0.5], generator), _group("b", [0.0, 1.0, 1.0, 1.0], generator)])
    norm = areal_data.Normalization(cli_args.NormConfig(mean_level="group", std_level="group", group_size=GROUP,
                                                        std_unbiased=False, eps=1e-6))
    theirs = norm(to_areal(short)["rewards"].clone())
    ours = group_advantages(short.tensors["rewards"], short.row_task)
    assert not numpy.allclose(theirs.numpy(), ours.numpy(), atol=1e-3)  # fixed-size slices straddle the groups
