"""An algorithm plugin: `fixture_sft`, SFT's settings and recipe under another kind (kept light:
the registry imports this module when it loads)."""

from rollout.algorithms.config import SFTConfig
from rollout.algorithms.registry import AlgorithmSpec

SPEC = AlgorithmSpec(
    "fixture_sft", SFTConfig, "sft", "rollout.algorithms.sft:train_sft", "SFT registered by a plugin package."
)
