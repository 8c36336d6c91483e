"""The sidecar table a config gives wherever a reward function, an env or a tool is accepted
(SPEC section 11); the process itself is `rollout.sidecar`.

    [[algorithm.grpo.rewards]]
    name = {kind = "sidecar", command = ["node", "reward.js"], timeout_s = 10}

    [algorithm.grpo.env]
    name = {kind = "sidecar", command = ["python", "env.py"], max_restarts = 3}
    tools = ["calculator", {kind = "sidecar", command = ["./tools.sh"]}]

The executable is checked at config time (found on PATH, or a file relative to `cwd`),
so a typo is a located error from `rollout validate`, not a failing run. No torch here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from rollout.config_base import ConfigPath, StrictModel


class SidecarConfig(StrictModel):
    """An executable speaking JSON-RPC 2.0 over stdio, one message per line (docs/sidecar-protocol.md)."""

    kind: Literal["sidecar"] = Field(description='"sidecar": a process speaking JSON-RPC 2.0 over stdio.')
    command: tuple[Annotated[str, Field(min_length=1)], ...] = Field(
        min_length=1, description='The program and its arguments, e.g. ["node", "reward.js"] (no shell).'
    )
    timeout_s: float = Field(10.0, gt=0, le=86400, description="Per call; a hung sidecar is killed and restarted.")
    max_restarts: int = Field(
        3, ge=0, le=1000, description="Restarts in a row (after a crash, hang or garbage) before it is given up."
    )
    cwd: ConfigPath = Field(
        Path("."), description="Working directory (relative to the config file; default: the config's folder)."
    )

    @model_validator(mode="after")
    def _executable_exists(self) -> SidecarConfig:
        program = self.command[0]
        if os.sep in program:
            path = Path(program) if Path(program).is_absolute() else self.cwd / program
            if not path.is_file():
                raise ValueError(f"sidecar executable {program!r} not found (looked at {path})")
            if not os.access(path, os.X_OK):
                raise ValueError(f"sidecar executable {path} is not executable (chmod +x it)")
        elif shutil.which(program) is None:
            raise ValueError(f"sidecar executable {program!r} not found on PATH")
        return self

    @property
    def label(self) -> str:
        """How metrics and messages name it: "sidecar:reward.js"."""
        return f"sidecar:{Path(self.command[-1]).name or self.command[-1]}"


def _ref_kind(value: Any) -> str:
    return "sidecar" if isinstance(value, Mapping | SidecarConfig) else "ref"


PluginRef = Annotated[
    Annotated[str, Tag("ref")] | Annotated[SidecarConfig, Tag("sidecar")],
    Discriminator(_ref_kind),
]
"""A built-in or plugin name, a 'module:attr' reference, or a `{kind = "sidecar", ...}` table."""
