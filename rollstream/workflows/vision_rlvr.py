"""RLVR with images: the prompt's images go through the model's processor and to the engine.

Parity with AReaL's vision workflow: the processor turns the chat and the
images into prompt ids (holding the image placeholder tokens) and the vision inputs a VLM
trainer needs; the engine gets the ids and the images as base64 ``image_data``; the result
holds, beside RLVR's keys, ``multi_modal_input`` (one dict per row with the processor's
``pixel_values`` and ``image_grid_thw``, AReaL's form).

In the pipeline the vision inputs do not travel: the rollout worker ships the encoded images
the engine saw, once per group, and the trainer side rebuilds ``pixel_values`` and
``image_grid_thw`` from them (docs/ARCHITECTURE.md, "Images travel once").
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from rollstream.api.engine import InferenceEngine
from rollstream.api.io_struct import GenerationHyperparameters, ModelRequest
from rollstream.runtime.stats import stats_tracker
from rollstream.trajectory.rows import trajectory_row
from rollstream.vision.images import IMAGES_KEY, image_bytes, image_list, open_image, to_base64
from rollstream.vision.inputs import MULTI_MODAL_KEY
from rollstream.workflows.rlvr import RewardFn, RLVRWorkflow



class VisionRLVRWorkflow(RLVRWorkflow):
    """One generation per episode over a prompt with images; returns a ``[1, L]`` row.

    ``data[image_key]``: the images (one or a list; bytes, PIL images, file paths, base64 or
    data URIs, or datasets' ``{"bytes", "path"}`` dicts). ``data[data_key]``: the chat, either
    a list of messages whose image slots are ``{"type": "image"}`` content items (rendered by
    the processor's chat template) or text that already holds the processor's image
    placeholder (``<|image_pad|>`` for Qwen2-VL) once per image; else ``data["prompt"]`` as
    text. The number of slots must equal the number of images (``ValueError`` otherwise).

    Result keys: RLVR's (``input_ids``, ``loss_mask``, ``logprobs``, ``versions``,
    ``attention_mask``, ``is_truncated``, ``rewards`` with a ``reward_fn``) and, when the prompt
    has images, ``multi_modal_input``: ``[{"pixel_values": [P, D], "image_grid_thw": [n, 3]}]``.
    ``reward_fn`` is called as in RLVR (``**data`` includes the images).
    """

    def __init__(
        self,
        gconfig: GenerationHyperparameters,
        tokenizer: Any,
        processor: Any,
        reward_fn: RewardFn | None = None,
        enable_thinking: bool = False,
        data_key: str = "messages",
        image_key: str = IMAGES_KEY,
        reward_timeout_seconds: float = 15.0,
        reward_max_retries: int = 3,
        reward_max_workers: int | None = None,
    ) -> None:
        if processor is None or not callable(processor):
            raise TypeError(
                "VisionRLVRWorkflow needs the model's processor (processor=\"$processor\" in rollout.workflows, "
                "or rollstream.vision.processor.load_processor(model_path))"
            )
        super().__init__(
            gconfig, tokenizer, reward_fn=reward_fn, enable_thinking=enable_thinking, data_key=data_key,
            reward_timeout_seconds=reward_timeout_seconds, reward_max_retries=reward_max_retries,
            reward_max_workers=reward_max_workers,
        )
        self.processor = processor
        self.image_key = image_key

    def prompt_text(self, data: Mapping[str, Any]) -> str:
        """The prompt as text with one image placeholder per image (see the class docstring)."""
        chat = data.get(self.data_key)
        if isinstance(chat, str):
            return chat
        if isinstance(chat, Sequence) and chat:
            # enable_thinking only when set: transformers 5 warns about unknown processor kwargs
            thinking = {"enable_thinking": True} if self.enable_thinking else {}
            return self.processor.apply_chat_template(list(chat), add_generation_prompt=True, tokenize=False, **thinking)
        if isinstance(data.get("prompt"), str):
            return data["prompt"]
        raise ValueError(
            f"cannot build a vision prompt: data has neither {self.data_key!r} (messages or text) nor "
            f"'prompt'; keys are {sorted(data)}"
        )

    def process(self, data: Mapping[str, Any]) -> tuple[dict[str, Tensor], list[bytes]]:
        """The processor's output for ``data`` (``input_ids`` ``[1, L]``, and with images
        ``pixel_values`` and ``image_grid_thw``) and the images as encoded bytes."""
        images = [image_bytes(img, f"data[{self.image_key!r}][{i}]") for i, img in enumerate(image_list(data.get(self.image_key)))]
        text = self.prompt_text(data)
        token = getattr(self.processor, "image_token", None)
        slots = text.count(token) if token else len(images)
        if slots != len(images):
            raise ValueError(
                f"the prompt has {slots} image slots ({token!r}, or {{'type': 'image'}} "
                f"content items) for {len(images)} images in data[{self.image_key!r}]; give one slot per image"
            )
        out = self.processor(
            images=[open_image(i) for i in images] or None, text=[text], padding=False, return_tensors="pt",
        )
        return dict(out), images

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> dict[str, Any]:
        processed, images = self.process(data)
        prompt_ids = [int(t) for t in processed["input_ids"][0].tolist()]
        req = ModelRequest(
            rid=uuid.uuid4().hex, input_ids=prompt_ids, gconfig=self.gconfig.new(), tokenizer=self.tokenizer,
            image_data=[to_base64(i) for i in images] or None,
        )
        resp = await engine.agenerate(req)
        reward = None if self.reward is None else await self.compute_reward(prompt_ids, resp, data)
        stats_tracker.record(seqlen=len(prompt_ids) + resp.output_len)
        if reward is not None:
            stats_tracker.record(reward=reward)
        result: dict[str, Any] = trajectory_row(
            prompt_ids, resp.output_tokens, resp.output_logprobs, resp.output_versions,
            reward=reward, is_truncated=resp.stop_reason == "length",
        )
        if images:
            result[MULTI_MODAL_KEY] = [
                {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
            ]
        return result
