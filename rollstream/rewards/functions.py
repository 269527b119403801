"""The built-in reward functions.

Every reward function has the signature
``fn(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data) -> float``
where ``data`` is the prompt's dataset row. They are module-level (picklable), so the reward
worker can run them in its process pool, and this module imports nothing heavy (no torch),
so pool workers start fast.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)


def _answer_text(data: dict[str, Any]) -> str:
    answer = data.get("answer")
    return "" if answer is None else str(answer).strip()


def exact_match_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    """1.0 when the completion contains ``data["answer"]`` as a standalone token, else 0.0.

    Precisely: the answer (``str(data["answer"])``, stripped) must occur in the completion
    with no letter, digit or underscore directly before or after it. So the answer ``7``
    matches ``"The answer is 7."``, ``"**7**"`` and ``"7<|im_end|>"`` but not ``"17"``,
    ``"70"`` or ``"7b"``; ``"3.5"`` does not match inside ``"13.5"``. The comparison is
    case-sensitive. A missing or empty answer scores 0.0.
    """
    answer = _answer_text(data)
    if not answer:
        return 0.0
    pattern = rf"(?<!\w){re.escape(answer)}(?!\w)"
    return 1.0 if re.search(pattern, completion) else 0.0


def math_verify_reward(
    prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any
) -> float:
    """1.0 when ``math-verify`` judges the completion's final answer equal to ``data["answer"]``.

    The gold answer and the completion are parsed with ``math_verify.parse`` (LaTeX such as
    ``\\boxed{7}`` and plain expressions); 0.0 when either cannot be parsed, or on any
    parsing or verification error.
    """
    from math_verify import parse, verify  # imported here: an optional dependency

    answer = _answer_text(data)
    if not answer or not completion.strip():
        return 0.0
    try:
        gold = parse(answer)
        if not gold:
            gold = parse(f"${answer}$")
        predicted = parse(completion)
        if not gold or not predicted:
            return 0.0
        return 1.0 if verify(gold, predicted) else 0.0
    except Exception as exc:  # noqa: BLE001 - an unparsable answer scores 0, never crashes
        log.debug("math_verify failed on answer %r: %s", answer, exc)
        return 0.0
