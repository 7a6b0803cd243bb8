"""Workloads and the Gymnasium environments ``rlctl/Overcommit-v0`` (env/overcommit_env.py) and
``rlctl/SharedGPU-v0`` (env/shared_gpu_env.py: several engines on one GPU).

The id is registered here by name only; ``gymnasium.make("rlctl/Overcommit-v0", scenario=...)``
imports the environment when it is first made.
"""
import gymnasium

ENV_ID = "rlctl/Overcommit-v0"
if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="env.overcommit_env:OvercommitEnv")

NODE_ENV_ID = "rlctl/SharedGPU-v0"  # several engines on one GPU (env/shared_gpu_env.py)
if NODE_ENV_ID not in gymnasium.registry:
    gymnasium.register(id=NODE_ENV_ID, entry_point="env.shared_gpu_env:SharedGPUEnv")
