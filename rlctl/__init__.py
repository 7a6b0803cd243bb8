"""rlctl: a reinforcement-learning memory-overcommit controller for paged-KV LLM inference engines."""

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here; rlctl --version prints it)
