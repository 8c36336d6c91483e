"""The `calculator` env (SPEC section 9): multi-turn tool use, reward on the final answer.

    env = CalculatorEnv()
    messages = await env.reset({"prompt": [{"role": "user", "content": "What is 123*45?"}], "answer": "5535"})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*45"}}</tool_call>'
    step = await env.step({"role": "assistant", "content": call})
    # step.messages == ({"role": "tool", "content": "5535", ...},), reward 0.0, done False
    step = await env.step({"role": "assistant", "content": "The answer is 5535."})   # reward 1.0, done True

An assistant message holding `<tool_call>` blocks is a tool turn: every call
runs (`rl.tools.execute_tool_calls`) and each result, errors included, goes
back as a tool message; the episode goes on. A message without one is the
final answer: reward 1.0 when its last integer equals row["answer"]. Capping
the number of turns is the episode loop's job (`max_turns`). Rows come from
`rollout data calculator` (`tasks/calculator.py`). This module doesn't import
`rl.envs`, so the env registry there can import it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.errors import ConfigError
from rollout.inference.types import Message
from rollout.rl.tools import Tool, execute_tool_calls, parse_tool_calls, tool_messages
from rollout.rl.types import StepResult
from rollout.tasks.calculator import answer_from_text, calculator_tool, is_correct


def score(text: str, answer: str) -> float:
    """1.0 when the last integer of `text` equals `answer`, else 0.0 (the final turn's reward; for eval)."""
    return 1.0 if is_correct(text, answer) else 0.0


class CalculatorEnv:
    """One tool-use episode: tool turns until a message without `<tool_call>`, which is scored."""

    def __init__(self, tools: Sequence[Tool] | None = None) -> None:
        self.tools: list[Tool] = list(tools) if tools is not None else [calculator_tool()]
        """Offered to the model (`apply_chat_template(tools=...)`) and run on its calls."""
        self._by_name = {tool.name: tool for tool in self.tools}
        self._answer: str | None = None
        self._turn = 0

    async def reset(self, row: Mapping[str, Any]) -> list[Message]:
        if "answer" not in row:
            raise ConfigError('the calculator env needs an "answer" field in every prompt row')
        self._answer = str(row["answer"])
        self._turn = 0
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [dict(m) for m in prompt]

    async def step(self, assistant_message: Message) -> StepResult:
        if self._answer is None:
            raise RuntimeError("CalculatorEnv.step called before reset")
        self._turn += 1
        content = assistant_message.get("content") or ""
        parsed = parse_tool_calls(content, turn=self._turn)
        if parsed.calls:
            results = await execute_tool_calls(parsed.calls, self._by_name)
            errors = [r.error for r in results if r.error is not None]
            info = {
                "tool_calls": len(results),
                "tool_errors": len(errors),
                "tool_error_kinds": {kind: errors.count(kind) for kind in sorted(set(errors))},
                "tool_results": tuple(results),  # for `ToolStats.record_episode`
            }
            return StepResult(tuple(tool_messages(results)), 0.0, False, info)
        return StepResult((), score(content, self._answer), True, {"extracted": answer_from_text(content)})
