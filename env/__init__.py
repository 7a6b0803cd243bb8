"""Workloads and the Gymnasium environment ``rlctl/Overcommit-v0`` (env/overcommit_env.py).

The id is registered here by name only; ``gymnasium.make("rlctl/Overcommit-v0", scenario=...)``
imports the environment when it is first made.
"""
import gymnasium

ENV_ID = "rlctl/Overcommit-v0"
if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="env.overcommit_env:OvercommitEnv")
