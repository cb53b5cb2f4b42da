"""Running RL frameworks' rollouts through turnstream, imported only by those who use them.

- ``rollouts``: one episode on the gateway (open a session, run an agent against its
  ``base_url``, close it with the reward) and its folded trajectories read back from the log
  (``sessions``: the session API; ``trajectories``: the TRAJ feed), shared per event loop, so a
  batch of concurrent samples uses one subscription.
- ``samples``: the training sample an episode becomes (forks, failures, length limits).
- ``policy``: ``publish_weight_version``, how a trainer that updates its own inference servers
  tells gateways which weight version they now serve.
- ``verl``: verl's agent loop (``TurnstreamAgentLoop``, registered as ``"turnstream"``); the
  only module that imports verl. Walkthrough: docs/verl.md.
"""
