"""AReaL's own code run unchanged in rollstream (docs/WORKFLOWS.md, "Bring AReaL code unchanged").

* :class:`~rollstream.areal.workflow.ArealWorkflow` runs an AReaL workflow as AReaL's executor
  runs it (``workflow``);
* the rollout worker exports AReaL's ``stats_tracker`` into rollstream's and resets it
  (``stats``).
"""
