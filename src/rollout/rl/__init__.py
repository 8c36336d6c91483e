"""RL harness: samples and batches, the data buffer, envs, reward functions and the rollout manager.

    from rollout.rl.types import Sample, RolloutBatch, Env, StepResult, RewardFn
    from rollout.rl.buffer import DataBuffer
    from rollout.rl.rewards import resolve_reward, score_batch
    from rollout.rl.envs import resolve_env, reward_from_env
    from rollout.rl.manager import RolloutManager

Importing this package is cheap (no torch).
"""
