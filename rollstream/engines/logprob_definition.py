"""THE definition of a generated token's logprob, and the sampling settings that would break it.

A token's logprob, as every engine reports it and the trainer recomputes it, is
``log_softmax(logits / T)[token]`` over the whole vocabulary, ``T`` the request's temperature
(1.0 for a greedy request). That is what the trainer's forward pass gives for the same weights,
so the rollout's logprob is the behaviour policy's in the PPO ratio.

The engines report what their sampler computed, which is that definition only when nothing but
the temperature shapes the distribution:

* ``top_p`` < 1 and ``top_k`` on: vLLM's ``processed_logprobs`` are renormalised over the kept
  tokens, SGLang's and the local engines' are not, and the distribution sampled from is the
  truncated one either way; the trainer knows neither;
* ``frequency_penalty``: every engine subtracts it before its logprob; the trainer does not;
* ``min_new_tokens`` > 0: stop tokens are masked before the logprob while fewer were generated.

So a **training** episode's requests must leave those settings off: :func:`check_trainable`
raises :class:`~rollstream.api.engine.InvalidRequestError` naming the setting (the
sample fails with that reason; the tier goes on). Eval episodes are never trained on and may
sample as they like. The choice over "ask the server for raw logprobs": raw logprobs are
taken before the temperature (vLLM's ``raw_logprobs``), so they are not the sampling
distribution's either; SGLang offers no per-request switch; and a truncated distribution's
ratio cannot be recomputed by a trainer that does not truncate alike.
"""

from __future__ import annotations

from typing import Any

from rollstream.api.io_struct import TOP_K_OFF, top_k_is_on
from rollstream.api.engine import InvalidRequestError

DEFINITION = "a token's logprob is log_softmax(logits / temperature) over the whole vocabulary"


def shaping_settings(gconfig: Any) -> list[str]:
    """The settings of ``gconfig`` that change a token's logprob away from :data:`DEFINITION`,
    each as ``name=value``; empty when there is none."""
    found: list[str] = []
    top_p = float(getattr(gconfig, "top_p", 1.0))
    if top_p < 1.0:
        found.append(f"top_p={top_p:g} (use 1.0)")
    top_k = int(getattr(gconfig, "top_k", TOP_K_OFF))
    if top_k_is_on(top_k):
        found.append(f"top_k={top_k} (use -1: off)")
    penalty = float(getattr(gconfig, "frequency_penalty", 0.0))
    if penalty != 0.0:
        found.append(f"frequency_penalty={penalty:g} (use 0.0)")
    min_new = int(getattr(gconfig, "min_new_tokens", 0))
    if min_new > 0:
        found.append(f"min_new_tokens={min_new} (use 0)")
    return found


def check_trainable(gconfig: Any) -> None:
    """Refuse a training request whose sampling settings change its tokens' logprobs."""
    found = shaping_settings(gconfig)
    if found:
        raise InvalidRequestError(
            f"gconfig {', '.join(found)}: {DEFINITION}, which the trainer recomputes; these settings change "
            "what the engine reports and samples from, so the sample cannot be trained on. Leave them off "
            "in training episodes (eval episodes may use them); see docs/ARCHITECTURE.md, 'A token's logprob'"
        )
