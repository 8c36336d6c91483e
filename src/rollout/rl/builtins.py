"""The built-in reward functions and envs, by the names a config uses: the one list.

Values are `module:attr` references (resolved by `rl/refs.py`, like a user's own
plugin), so reading the names imports nothing: the config schema and
`rollout validate` list them without loading the RL harness.

    [[algorithm.grpo.rewards]]
    name = "arithmetic_correct"        # a key of BUILTIN_REWARDS, or "my_pkg.rewards:exact"

Installed packages add names through entry points (`rollout.plugins`, which merges them with
these and refuses a clash); sidecars are tables, not names (`rollout.sidecar`).
"""

from __future__ import annotations

BUILTIN_REWARDS: dict[str, str] = {
    "arithmetic_correct": "rollout.rl.rewards:arithmetic_correct",
    "math_answer": "rollout.rl.rewards:math_answer",
    "format_answer_only": "rollout.rl.rewards:format_answer_only",
}
BUILTIN_ENVS: dict[str, str] = {
    "arithmetic": "rollout.rl.envs:ArithmeticEnv",
    "math": "rollout.rl.envs:MathAnswerEnv",
    "calculator": "rollout.rl.calculator_env:CalculatorEnv",
    "python_code": "rollout.rl.code_env:PythonCodeEnv",
    "guess_number": "rollout.rl.guess_env:GuessNumberEnv",
}
BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "rollout.rl.calc:calculator",
    "python": "rollout.rl.python_tool:python",
}
