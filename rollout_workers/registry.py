"""The worker's workflow allow-list: message keys -> workflows named in the config.

A prompt message never carries code. Its ``workflow`` field may only name a key of this
registry (``None`` means ``rollout.default_workflow``); anything else — including an import
path — raises :class:`UnknownWorkflowError`, which the worker turns into a ``TaskFailed``
and a dead letter.

Keys come from ``rollout.workflows`` (``key: {path, kwargs}``) plus the built-in ``rlvr``
(``RLVRWorkflow`` with the configured generation settings and the model's tokenizer) unless
the config redefines it. ``path`` is an import string (``pkg.module.Name`` or
``pkg.module:Name``) or one of the built-in names ``rlvr``, ``multi_turn``, ``vision_rlvr``.

Special values in ``kwargs`` (also inside nested lists and dicts):

* ``"$tokenizer"`` -> the tokenizer of ``rollout.tokenizer_path`` (default: the model path);
* ``"$gconfig"`` -> ``GenerationHyperparameters().new(**rollout.gconfig)`` with the tokenizer's
  stop and pad token ids added; for a class of AReaL's (a subclass of
  ``areal.api.workflow_api.RolloutWorkflow``) AReaL's own ``areal.api.cli_args.GenerationHyperparameters``
  built the same way, which is what such a class expects;
* ``"$processor"`` -> the processor of ``rollout.processor_path`` (default: the tokenizer path),
  loaded once and only when a workflow asks for it (``rollstream.vision.processor.load_processor``);
* a ``reward_fn`` given as a string is imported (``pkg.module.fn``), since the built-in
  workflows take a callable.

The tokenizer is ``AutoTokenizer.from_pretrained`` as transformers makes it, for rollstream's
workflows and AReaL's alike. An AReaL workflow class runs as AReaL runs it
(``rollstream.areal.workflow``).

An entry whose object is an agent (``async def run(data, **extra)``) is served by the worker's
OpenAI-compatible agent endpoint (``rollout.agent``, ``rollstream.agent``), started with the
worker; its ``kwargs`` go to the agent's class.

The built-in workflows get ``gconfig="$gconfig"`` and ``tokenizer="$tokenizer"`` (and
``vision_rlvr`` ``processor="$processor"``) unless the kwargs set them, so ``multi_turn: {path:
multi_turn, kwargs: {reward_fn: pkg.mod.fn, max_turns: 2, turn_discount: 0.9}}`` is a complete
entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rollstream.agent import AgentEndpoint, AgentWorkflow
from rollstream.areal.workflow import is_areal_workflow
from rollstream.api.io_struct import GenerationHyperparameters
from rollstream.api.workflow import RolloutWorkflow
from rollstream.engines.logprob_definition import shaping_settings
from rollstream.config import ConfigError, RolloutConfig, WorkflowSpec
from rollstream.imports import import_object
from rollstream.runtime.import_effects import undo_import_effects
from rollstream.rewards.wrapper import close_workflow
from rollstream.workflows.resolve import resolve_workflow

log = logging.getLogger(__name__)

TOKENIZER_PLACEHOLDER = "$tokenizer"
GCONFIG_PLACEHOLDER = "$gconfig"
PROCESSOR_PLACEHOLDER = "$processor"
BUILTIN_PATHS = {
    "rlvr": "rollstream.workflows.rlvr:RLVRWorkflow",
    "multi_turn": "rollstream.workflows.multi_turn:MultiTurnWorkflow",
    "vision_rlvr": "rollstream.workflows.vision_rlvr:VisionRLVRWorkflow",
}
DEFAULT_WORKFLOWS = {"rlvr": WorkflowSpec(path="rlvr")}


class UnknownWorkflowError(LookupError):
    """A message named a workflow that is not a key of the worker's allow-list."""


def make_gconfig(settings: dict[str, Any], tokenizer: Any, settings_type: type = GenerationHyperparameters) -> Any:
    """``rollout.gconfig`` as generation settings with the tokenizer's stop/pad ids, of
    ``settings_type`` (rollstream's, or AReaL's for AReaL's classes: :func:`areal_settings_type`)."""
    try:
        gconfig = settings_type().new(**settings)
    except TypeError as exc:
        raise ConfigError(f"invalid configuration: rollout.gconfig: {exc}") from None
    return gconfig.new_with_stop_and_pad_token_ids(tokenizer)


def areal_settings_type() -> type:
    """AReaL's ``GenerationHyperparameters`` (imports ``areal``: only for AReaL's classes)."""
    from areal.api.cli_args import GenerationHyperparameters as ArealGenerationHyperparameters

    return ArealGenerationHyperparameters


def _no_processor() -> Any:
    raise ConfigError("invalid configuration: \"$processor\" needs rollout.processor_path (or a tokenizer or model path)")


def _substitute(value: Any, tokenizer: Any, gconfig: Any, processor: Callable[[], Any]) -> Any:
    if value == TOKENIZER_PLACEHOLDER:
        return tokenizer
    if value == GCONFIG_PLACEHOLDER:
        return gconfig.new()  # each workflow gets its own copy
    if value == PROCESSOR_PLACEHOLDER:
        return processor()
    if isinstance(value, list):
        return [_substitute(v, tokenizer, gconfig, processor) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, tokenizer, gconfig, processor) for k, v in value.items()}
    return value


def build_kwargs(
    spec: WorkflowSpec, tokenizer: Any, gconfig: Any, processor: Callable[[], Any] = _no_processor,
) -> dict[str, Any]:
    """The constructor kwargs of ``spec`` with placeholders replaced (see the module doc);
    ``gconfig`` is what ``"$gconfig"`` stands for (each use gets a copy), ``processor()`` what
    ``"$processor"`` stands for."""
    kwargs = dict(spec.kwargs)
    if spec.path in BUILTIN_PATHS:
        kwargs.setdefault("gconfig", GCONFIG_PLACEHOLDER)
        kwargs.setdefault("tokenizer", TOKENIZER_PLACEHOLDER)
    if spec.path == "vision_rlvr":
        kwargs.setdefault("processor", PROCESSOR_PLACEHOLDER)
    kwargs = _substitute(kwargs, tokenizer, gconfig, processor)
    if isinstance(kwargs.get("reward_fn"), str):
        kwargs["reward_fn"] = import_object(kwargs["reward_fn"])
    return kwargs


class WorkflowRegistry:
    """Workflows by allow-list key, built once at start (bad entries fail the start)."""

    def __init__(
        self, workflows: dict[str, RolloutWorkflow], default_key: str, endpoint: AgentEndpoint | None = None,
    ) -> None:
        if default_key not in workflows:
            raise ConfigError(
                f"invalid configuration: rollout.default_workflow {default_key!r} is not a key of "
                f"rollout.workflows (known: {', '.join(sorted(workflows))})"
            )
        self._workflows = workflows
        self.default_key = default_key
        self.endpoint = endpoint  # the agent endpoint, when an entry is an agent (start it with the worker)

    @classmethod
    def from_config(cls, config: RolloutConfig, tokenizer: Any) -> WorkflowRegistry:
        """Build every configured workflow (plus the built-in ``rlvr``) with ``tokenizer``."""
        gconfig = make_gconfig(config.gconfig, tokenizer)
        shaping = shaping_settings(gconfig)
        if shaping:
            log.warning("rollout.gconfig sets %s: training samples that sample with it fail (a token's logprob "
                        "must be the one the trainer recomputes: docs/ARCHITECTURE.md, 'A token's logprob'); "
                        "only eval prompts may use it", ", ".join(shaping))
        specs = {**DEFAULT_WORKFLOWS, **config.workflows}
        processor = _processor_loader(config)
        workflows = {
            key: _build(key, spec, tokenizer, gconfig, processor, config.gconfig) for key, spec in specs.items()
        }
        endpoint = _serve_agents(workflows, config, tokenizer, gconfig)
        undo_import_effects()  # workflow code that imported AReaL replaced the logger hierarchy
        log.info("workflow allow-list: %s (default %s)", ", ".join(sorted(workflows)), config.default_workflow)
        return cls(workflows, config.default_workflow, endpoint)

    def keys(self) -> list[str]:
        return sorted(self._workflows)

    def resolve(self, key: str | None) -> RolloutWorkflow:
        """The workflow for a message's ``workflow`` field (``None``: the default)."""
        name = self.default_key if key is None else key
        workflow = self._workflows.get(name)
        if workflow is None:
            raise UnknownWorkflowError(
                f"workflow {name!r} is not allowed: a prompt may only name a key of "
                f"rollout.workflows ({', '.join(self.keys())})"
            )
        return workflow

    async def aclose(self) -> None:
        """Release what the workflows hold (see ``close_workflow``)."""
        for key, workflow in self._workflows.items():
            try:
                await close_workflow(workflow)
            except Exception:  # closing must go on for the others
                log.exception("closing workflow %s failed", key)
        if self.endpoint is not None:
            await self.endpoint.close()


def _processor_loader(config: RolloutConfig) -> Callable[[], Any]:
    """Loads the processor on first call (text-only workers never do), then returns the same one."""
    path = config.processor_path or config.tokenizer_path or config.model_path
    loaded: list[Any] = []

    def load() -> Any:
        if not path:
            return _no_processor()
        if not loaded:
            from rollstream.vision.processor import load_processor

            loaded.append(load_processor(path))
            log.info("loaded the processor for \"$processor\" from %s", path)
        return loaded[0]

    return load


def _build(
    key: str, spec: WorkflowSpec, tokenizer: Any, gconfig: GenerationHyperparameters, processor: Callable[[], Any],
    settings: dict[str, Any],
) -> RolloutWorkflow:
    path = BUILTIN_PATHS.get(spec.path, spec.path)
    try:
        if is_areal_workflow(import_object(path)):  # AReaL's class: AReaL's settings type
            gconfig = make_gconfig(settings, tokenizer, areal_settings_type())
        kwargs = build_kwargs(spec, tokenizer, gconfig, processor)
        # group_size=1: the worker runs (and publishes) every sample of a group itself.
        return resolve_workflow(path, kwargs, group_size=1)
    except Exception as exc:
        raise ConfigError(
            f"invalid configuration: rollout.workflows.{key} (path {spec.path!r}) cannot be built: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _serve_agents(
    workflows: dict[str, RolloutWorkflow], config: RolloutConfig, tokenizer: Any, gconfig: GenerationHyperparameters,
) -> AgentEndpoint | None:
    """One agent endpoint (``rollout.agent``) for every agent entry, which is re-bound to it."""
    agents = [key for key, workflow in workflows.items() if isinstance(workflow, AgentWorkflow)]
    if not agents:
        return None
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"invalid configuration: rollout.workflows {agents} are agents, which need a chat template, and the "
            "tokenizer of rollout.tokenizer_path (or model_path) has none"
        )
    model_name = config.model_path.rstrip("/").rsplit("/", 1)[-1] or "rollstream"
    endpoint = AgentEndpoint(config.agent, tokenizer, gconfig, model_name)
    for key in agents:
        workflows[key] = workflows[key].served_by(endpoint, config.agent)  # type: ignore[attr-defined]
    return endpoint
