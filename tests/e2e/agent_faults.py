"""The example calculator agent with faults injected by the data, for the agent pipeline test.

``data["fault"]``: "raise" (every sample raises), "hang" (every sample hangs until the
worker's timeout cancels it), "raise-one" / "hang-one" (only sample 0 / 1 does). The agent
also records how many of its episodes ran at once (``record_to``: the peak, one number), so
the test can check that agents count against ``rollout.max_concurrent_rollouts``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from examples.agent_calculator import CalculatorAgent
from rollstream.api.context import workflow_context


class FaultyCalculator(CalculatorAgent):
    running = 0
    peak = 0

    def __init__(self, record_to: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record_to = Path(record_to)

    async def run(self, data: dict[str, Any], **extra: Any) -> float:
        cls = type(self)
        cls.running += 1
        if cls.running > cls.peak:
            cls.peak = cls.running
            self.record_to.write_text(str(cls.peak))
        try:
            fault, sample = data.get("fault", ""), workflow_context.sample_idx
            if fault == "raise" or (fault == "raise-one" and sample == 0):
                raise RuntimeError("injected fault")
            if fault == "hang" or (fault == "hang-one" and sample == 1):
                await asyncio.sleep(3600)
            return await super().run(data, **extra)
        finally:
            cls.running -= 1
