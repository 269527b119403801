"""Code an AReaL user brings, written on AReaL's own imports (``pip install areal``): a reward
function with AReaL's signature and a workflow subclassing AReaL's ``RolloutWorkflow`` that uses
AReaL's workflow context, stats tracker, reward wrapper and session tracing."""
