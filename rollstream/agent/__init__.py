"""Agent workflows: an OpenAI-compatible endpoint beside the engine that turns any agent's chat
calls into trainable trajectories (docs/WORKFLOWS.md, "Write an agent workflow").

* :class:`AgentWorkflow` runs an object with ``async def run(data, **extra)`` (``workflow``);
* :class:`AgentEndpoint` serves the sessions (``endpoint``), one per episode (``session``);
* what a request becomes: prompt tokens (``chat_template``), a reply with tool calls
  (``completions``, ``tool_calls``), turns chained into rows (``conversation``).
"""

from rollstream.agent.endpoint import AgentEndpoint
from rollstream.agent.session import AgentSession
from rollstream.agent.workflow import AgentError, AgentWorkflow

__all__ = ["AgentEndpoint", "AgentError", "AgentSession", "AgentWorkflow"]
