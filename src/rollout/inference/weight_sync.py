"""How a trainer's new weights reach the engine that samples: the `WeightSync` seam.

    sync = InProcessWeightSync(engine)                       # hf engine in this process
    sync = DiskReloadWeightSync(engine, run_dir / "weights") # a server (HTTP reload) or vLLM
    sync.push(weights, version=3)                            # before sampling with policy version 3
    if sync.keeps_serving:                                   # the engine outlives the run
        sync.push(final_weights, version=last)

Today: tensors handed over in-process, or a folder of safetensors the engine
reloads (`/update_weights_from_disk` on a `rollout serve` / SGLang-style
server through `OpenAIEngine`, or vLLM's own loader). A Ray object store or
NCCL broadcast are further implementations of the same two members.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rollout.inference.types import InferenceEngine

if TYPE_CHECKING:
    import torch


class WeightSync(Protocol):
    keeps_serving: bool
    """The engine outlives the run (a server users may keep querying): it should get the final policy."""

    def push(self, weights: Mapping[str, torch.Tensor], *, version: int) -> None:
        """Make the engine sample with `weights` (policy version `version`) from its next request on."""
        ...


class InProcessWeightSync:
    """The engine runs in this process: it copies the tensors into its live model."""

    keeps_serving = False

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine

    def push(self, weights: Mapping[str, torch.Tensor], *, version: int) -> None:
        self.engine.update_weights(weights)


class DiskReloadWeightSync:
    """The engine reloads from a folder this run writes: `root/v<version>/model.safetensors`.

    A remote server must see the same filesystem (as with SGLang's
    `update_weights_from_disk`); once the engine has loaded a version, the
    folders of older versions are removed so pushes do not pile up.
    """

    keeps_serving = True

    def __init__(self, engine: InferenceEngine, root: Path) -> None:
        self.engine = engine
        self.root = Path(root)

    def push(self, weights: Mapping[str, torch.Tensor], *, version: int) -> None:
        import safetensors.torch

        folder = self.root / f"v{version}"
        folder.mkdir(parents=True, exist_ok=True)
        # a copy of every tensor: tied weights (embeddings = lm_head) share storage, which safetensors refuses
        safetensors.torch.save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()},
                                    folder / "model.safetensors")
        self.engine.update_weights(str(folder))
        for old in self.root.iterdir():
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
