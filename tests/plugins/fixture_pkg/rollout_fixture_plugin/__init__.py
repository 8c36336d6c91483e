"""Test plugins for rollout (registered in pyproject.toml under `rollout.plugins`)."""
