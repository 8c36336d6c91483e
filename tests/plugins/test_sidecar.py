"""Sidecars (SPEC section 11): reward functions, envs and tools served over JSON-RPC on stdio by
real processes in Python, Node.js and shell, well-behaved and not: crash, hang, garbage, wrong
ids, error objects. Every test checks that no process outlives it (conftest.py).

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/plugins/test_sidecar.py -q
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollout.algorithms.config import EpisodeEnvConfig
from rollout.errors import ConfigError
from rollout.rl.envs import resolve_env
from rollout.rl.rewards import resolve_reward, score_batch
from rollout.rl.tools import execute_tool_calls, parse_tool_calls, resolve_tools
from rollout.sidecar import Sidecar, SidecarError, SidecarReward, close_sidecars
from rollout.sidecar_config import SidecarConfig

SIDECARS = Path(__file__).resolve().parent / "sidecars"
LANGS = [
    pytest.param([sys.executable, str(SIDECARS / "reward.py")], id="python"),
    pytest.param(
        ["node", str(SIDECARS / "reward.js")], id="node",
        marks=pytest.mark.skipif(shutil.which("node") is None, reason="Node.js (node) is not on PATH"),
    ),
]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def reward(command, *args, timeout_s=5.0, max_restarts=3):
    cfg = SidecarConfig(kind="sidecar", command=(*command, *args), timeout_s=timeout_s, max_restarts=max_restarts)
    fn = resolve_reward(cfg)
    assert isinstance(fn, SidecarReward)
    return fn


async def score(fn, completions, answers=None):
    """`score_batch` as the rollout manager calls it: (rewards, failures)."""
    fields = {} if answers is None else {"answer": answers}
    rewards, _, failures = await score_batch([("side", fn, 1.0)], ["q"] * len(completions), completions, fields,
                                             timeout_s=30.0)
    return rewards, failures


# --- rewards ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", LANGS)
def test_reward_sidecar_scores_batches(command):
    """Length + 1000 when the completion equals the row's answer; an empty completion abstains."""
    fn = reward(command)

    async def run():
        first = await score(fn, ["11", "abc", ""], answers=[11, 3, 4])
        second = await score(fn, ["hello"])
        await close_sidecars()
        return first, second

    (rewards, failures), (rewards2, _) = asyncio.run(run())
    assert rewards == [1002.0, 3.0, None] and failures == [None, None, None]
    assert rewards2 == [5.0]
    assert fn.sidecar.restarts == 0


@pytest.mark.skipif(shutil.which("jq") is None, reason="the shell sidecar needs jq")
def test_shell_script_sidecar_scores_word_counts():
    fn = reward([str(SIDECARS / "reward.sh")])

    async def run():
        try:
            return await score(fn, ["one two  three", "x", ""])
        finally:
            await close_sidecars()

    assert asyncio.run(run()) == ([3.0, 1.0, 0.0], [None, None, None])


@pytest.mark.parametrize("command", LANGS)
def test_crash_drops_the_batch_then_restarts_and_continues(command):
    fn = reward(command, "crash_after", "1")

    async def run():
        out = [await score(fn, ["ab", "c"]) for _ in range(3)]
        await close_sidecars()
        return out

    (ok1, _), (lost, reasons), (ok2, _) = asyncio.run(run())
    assert ok1 == [2.0, 1.0] and ok2 == [2.0, 1.0]  # the restarted process scores again
    assert lost == [None, None]
    who = f'sidecar "{command[0]} {command[1]} crash_after 1"'
    assert reasons[0] == reasons[1] and reasons[0].startswith(f"reward fn side raised SidecarError: {who}: exited with code 3")
    assert "crashing on call 2" in reasons[0]  # its stderr
    assert "restarting it (1 of 3 restarts in a row)" in reasons[0]
    assert fn.sidecar.restarts == 1


@pytest.mark.parametrize("command", LANGS)
def test_hang_times_out_kills_and_restarts(command):
    fn = reward(command, "hang_after", "1", timeout_s=1.5)

    async def run():
        first = await score(fn, ["ab"])
        started = time.monotonic()
        hung = await score(fn, ["ab"])
        waited = time.monotonic() - started
        after = await score(fn, ["xyz"])
        await close_sidecars()
        return first, hung, waited, after

    first, (lost, reasons), waited, after = asyncio.run(run())
    assert first == ([2.0], [None]) and after == ([3.0], [None])
    assert lost == [None] and "timed out after 1.5s on reward.score" in reasons[0]
    assert "hanging on call 2" in reasons[0]
    assert 1.5 <= waited < 5.0
    assert fn.sidecar.restarts == 1


@pytest.mark.parametrize("command", LANGS)
def test_repeated_crashes_are_bounded_then_every_call_fails_fast(command):
    fn = reward(command, "crash_after", "0", max_restarts=2)

    async def run():
        out = [await score(fn, ["a", "b"]) for _ in range(3)]
        started = time.monotonic()
        out.append(await score(fn, ["a", "b"]))
        return out, time.monotonic() - started

    results, last_s = asyncio.run(run())
    reasons = [failures[0] for _, failures in results]
    assert all(rewards == [None, None] for rewards, _ in results)  # dropped, counted by the manager
    assert "restarting it (1 of 2" in reasons[0] and "restarting it (2 of 2" in reasons[1]
    assert "given up after 2 restart(s) in a row" in reasons[2]
    assert reasons[3] == reasons[2] and last_s < 0.2  # no new process: the same error at once
    assert fn.sidecar.restarts == 2 and fn.sidecar.given_up


@pytest.mark.parametrize("command", LANGS)
@pytest.mark.parametrize(("mode", "message"), [
    ("garbage", "wrote a line that is not JSON: '"),
    ("wrong_id", "answered id 1002, which matches no pending request"),
])
def test_garbage_and_wrong_ids_are_one_clear_error(command, mode, message):
    fn = reward(command, mode)

    async def run():
        try:
            with pytest.raises(SidecarError) as caught:
                await fn(["q"], ["ab"])
            return str(caught.value)
        finally:
            await close_sidecars()

    text = asyncio.run(run())
    assert text.startswith(f'sidecar "{command[0]} {command[1]} {mode}": {message}'), text
    assert text.endswith("restarting it (1 of 3 restarts in a row)")


@pytest.mark.parametrize("command", LANGS)
def test_error_objects_fail_the_call_only(command):
    fn = reward(command, "error")

    async def run():
        try:
            return [await score(fn, ["ab"]) for _ in range(2)]
        finally:
            await close_sidecars()

    for rewards, failures in asyncio.run(run()):
        assert rewards == [None] and failures[0].endswith("reward.score failed: judge unavailable (code -32000)")
    assert fn.sidecar.restarts == 0 and not fn.sidecar.given_up


@pytest.mark.parametrize("command", LANGS)
def test_exit_at_start_shows_its_stderr(command):
    fn = reward(command, "exit_on_start", max_restarts=0)
    with pytest.raises(SidecarError, match=r"exited with code 5; stderr: .*missing API key; given up after 0"):
        asyncio.run(fn(["q"], ["ab"]))


@pytest.mark.parametrize(("mode", "message"), [
    ("bad_describe", r"bad describe answer: \"kinds\" must be a non-empty list .*not restarting it"),
    ("env_only", r"does not serve reward\.score: its describe lists kinds \['env'\]"),
    ("bad_shape", r'reward\.score must answer \{"rewards": \[\.\.\.\]\}, got \[1, 2, 3\]'),
])
def test_wrong_answers_name_the_sidecar(mode, message):
    fn = reward([sys.executable, str(SIDECARS / "reward.py")], mode)

    async def run():
        try:
            await fn(["q"], ["ab"])
        finally:
            await close_sidecars()

    with pytest.raises(SidecarError, match=rf'^sidecar ".*reward\.py {mode}":? .*{message}'):
        asyncio.run(run())


def test_stopping_kills_the_sidecars_children_too():
    sidecar = Sidecar([sys.executable, str(SIDECARS / "reward.py"), "spawn_child"])

    async def run():
        await sidecar.call("reward.score", {"prompts": ["q"], "completions": ["a"], "fields": {}})
        child = sidecar.info["child_pid"]
        assert _alive(child)
        await sidecar.aclose()
        return child

    child = asyncio.run(run())
    deadline = time.monotonic() + 2.0
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def test_a_new_event_loop_gets_a_new_process():
    """A sidecar used by two `asyncio.run`s (e.g. `validate`, then training) works in both."""
    fn = reward([sys.executable, str(SIDECARS / "reward.py")])
    assert asyncio.run(fn(["q"], ["abc"])) == [3.0]

    async def second():
        try:
            return await fn(["q"], ["abcd"])
        finally:
            await close_sidecars()

    assert asyncio.run(second()) == [4.0]
    assert fn.sidecar.restarts == 0


def test_a_caller_giving_up_during_start_leaves_nothing_behind():
    """`score_batch` / the episode loop cancel a call at their own timeout, here mid-start (the
    sidecar takes 0.5 s to start, the caller waits 0.05 s)."""
    fn = reward([sys.executable, str(SIDECARS / "reward.py"), "slow_start"])

    async def run():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(fn(["q"], ["abc"]), 0.05)
        try:
            return await fn(["q"], ["abcd"])
        finally:
            await close_sidecars()

    assert asyncio.run(run()) == [4.0]
    assert fn.sidecar.restarts == 0


# --- config -------------------------------------------------------------------------------------


def test_config_checks_the_executable(tmp_path):
    script = tmp_path / "judge.sh"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(ValidationError, match="sidecar executable 'no-such-sidecar-xyz' not found on PATH"):
        SidecarConfig(kind="sidecar", command=["no-such-sidecar-xyz"])
    with pytest.raises(ValidationError, match=r"sidecar executable './missing\.sh' not found \(looked at"):
        SidecarConfig.model_validate({"kind": "sidecar", "command": ["./missing.sh"]}, context={"base_dir": tmp_path})
    with pytest.raises(ValidationError, match="is not executable"):
        SidecarConfig.model_validate({"kind": "sidecar", "command": ["./judge.sh"]}, context={"base_dir": tmp_path})
    with pytest.raises(ValidationError, match="at least 1 item"):
        SidecarConfig(kind="sidecar", command=[])
    script.chmod(0o755)
    cfg = SidecarConfig.model_validate({"kind": "sidecar", "command": ["./judge.sh"]}, context={"base_dir": tmp_path})
    assert cfg.cwd == tmp_path and cfg.timeout_s == 10.0 and cfg.max_restarts == 3 and cfg.label == "sidecar:judge.sh"


def test_env_table_takes_a_sidecar_name_and_sidecar_tools():
    tool = {"kind": "sidecar", "command": [sys.executable, str(SIDECARS / "tool.py")]}
    env = EpisodeEnvConfig.model_validate({"name": "calculator", "tools": ["calculator", tool]})
    assert isinstance(env.tools[1], SidecarConfig)
    side = EpisodeEnvConfig.model_validate({"name": {"kind": "sidecar", "command": [sys.executable, "env.py"]}})
    assert isinstance(side.name, SidecarConfig)
    with pytest.raises(ValidationError, match="a sidecar env lists its own tools"):
        EpisodeEnvConfig.model_validate({"name": side.name.model_dump(), "tools": ["calculator"]})
    with pytest.raises(ValidationError, match="unknown tool 'nope'"):
        EpisodeEnvConfig.model_validate({"name": "calculator", "tools": ["nope"]})
    slow = {**side.name.model_dump(), "timeout_s": 30}
    with pytest.raises(ValidationError, match=r"timeout_s \(30\) must be below step_timeout_s \(30\)"):
        EpisodeEnvConfig.model_validate({"name": slow})


def test_a_sidecar_reward_entry_in_a_run_config():
    from rollout.algorithms.config import GRPOConfig, SidecarRewardSpec

    base = {"minibatch_size": 2, "base_model": {"uri": "m"}, "optimizer": {"kind": "adamw", "lr": 1e-3},
            "budget": {"max_steps": 1}, "dataset": {"path": "d.jsonl"}}
    entry = {"kind": "sidecar", "command": ["node", "reward.js"], "weight": 0.5}
    if shutil.which("node") is None:
        entry["command"] = [sys.executable, "reward.js"]
    cfg = GRPOConfig.model_validate({**base, "rewards": [{"name": "arithmetic_correct"}, entry]})
    side = cfg.rewards[1]
    assert isinstance(side, SidecarRewardSpec) and side.label == "sidecar:reward.js" and side.weight == 0.5
    with pytest.raises(ValidationError, match=r"sidecar:reward\.js: the sidecar's timeout_s \(40\) must be below"):
        GRPOConfig.model_validate({**base, "rewards": [{**entry, "timeout_s": 40}]})
    with pytest.raises(ValidationError, match="rewards.0.sidecar.command"):
        GRPOConfig.model_validate({**base, "rewards": [{"kind": "sidecar", "weight": 1.0}]})


# --- envs ---------------------------------------------------------------------------------------


def env_factory(*args):
    command = (sys.executable, str(SIDECARS / "env.py"), *args)
    return resolve_env(SidecarConfig(kind="sidecar", command=command, timeout_s=5.0))


def test_env_sidecar_serves_concurrent_episodes():
    factory = env_factory()
    rows = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": [{"role": "user", "content": "Hi"}], "answer": "7"}]

    async def run():
        envs = [factory(turns=2), factory(turns=2), factory(turns=1)]
        opening = await asyncio.gather(*(env.reset(row) for env, row in zip(envs, [*rows, rows[0]], strict=True)))
        first = await asyncio.gather(*(env.step({"role": "assistant", "content": "it is 4"}) for env in envs))
        second = await asyncio.gather(*(env.step({"role": "assistant", "content": "7!"}) for env in envs[:2]))
        await close_sidecars()
        return envs, opening, first, second

    envs, opening, first, second = asyncio.run(run())
    assert opening[0] == [{"role": "user", "content": "What is 2+2?"}] and opening[1] == rows[1]["prompt"]
    assert [s.reward for s in first] == [1.0, 0.7, 1.0] and [s.done for s in first] == [False, False, True]
    assert first[0].messages == ({"role": "user", "content": "turn 1 done, go on"},) and first[2].messages == ()
    assert [s.reward for s in second] == [0.2, 1.0] and all(s.done for s in second)
    assert second[0].info == {"turn": 2}
    assert [t.openai_schema()["function"]["name"] for t in envs[0].tools] == ["peek"]  # for the chat template
    assert len({env.episode_id for env in envs}) == 3


def test_env_sidecar_restart_ends_the_episodes_whose_state_it_lost():
    factory = env_factory("crash_after", "1")

    async def run():
        a, b = factory(), factory()
        await asyncio.gather(a.reset({"prompt": "p"}), b.reset({"prompt": "q"}))
        await a.step({"role": "assistant", "content": "x"})
        with pytest.raises(SidecarError, match="exited with code 3"):
            await b.step({"role": "assistant", "content": "y"})
        with pytest.raises(SidecarError, match="was restarted since this episode began: its state there is lost"):
            await a.step({"role": "assistant", "content": "z"})
        fresh = factory(turns=1)
        await fresh.reset({"prompt": "r", "answer": "5"})
        result = await fresh.step({"role": "assistant", "content": "5"})
        await close_sidecars()
        return result

    result = asyncio.run(run())
    assert result.reward == 1.0 and result.done


# --- tools --------------------------------------------------------------------------------------


def test_tool_sidecar_tools_run_and_fail_as_tool_errors():
    sidecar = SidecarConfig(kind="sidecar", command=(sys.executable, str(SIDECARS / "tool.py")), timeout_s=1.5)
    tools = {t.name: t for t in resolve_tools(["calculator", sidecar])}
    assert list(tools) == ["calculator", "reverse", "add", "nap"]
    assert tools["add"].parameters["required"] == ["a", "b"]
    text = (
        '<tool_call>{"name": "reverse", "arguments": {"text": "abc"}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "2"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    )

    async def run():
        results = await execute_tool_calls(parse_tool_calls(text).calls, tools)
        napped = await execute_tool_calls(parse_tool_calls(
            '<tool_call>{"name": "nap", "arguments": {"seconds": 30}}</tool_call>').calls, tools)
        again = await execute_tool_calls(parse_tool_calls(
            '<tool_call>{"name": "reverse", "arguments": {"text": "ok"}}</tool_call>').calls, tools)
        await close_sidecars()
        return results, napped[0], again[0]

    results, napped, again = asyncio.run(run())
    assert [r.content for r in results[:2]] == ["cba", "42"] and results[3].content == "42"
    assert results[2].error == "bad_arguments"  # checked against the advertised schema before any call
    assert napped.error == "tool_raised" and "timed out after 1.5s on tool.call" in napped.content
    assert again.content == "ko" and again.error is None  # restarted


def test_env_without_a_tools_argument_refuses_tools():
    from rollout.algorithms.rl_common import episode_setup

    tool = {"kind": "sidecar", "command": [sys.executable, str(SIDECARS / "tool.py")]}
    setup = episode_setup(EpisodeEnvConfig.model_validate({"name": "calculator", "tools": [tool]}), tokenizer=None)
    assert [t.name for t in setup.env_factory().tools] == ["reverse", "add", "nap"]
    with pytest.raises(ConfigError, match="env 'arithmetic' takes no `tools` argument"):
        episode_setup(EpisodeEnvConfig.model_validate({"name": "arithmetic", "tools": ["calculator"]}), tokenizer=None)
