"""Multi-turn episodes/s: rollout's episode loop vs a naive re-prefill loop vs a batched re-render loop vs TRL.

    .venv/bin/python benchmarks/multiturn.py                              # default: 32 episodes x 4 turns x 24 tokens, ~2 min
    .venv/bin/python benchmarks/multiturn.py --episodes 16 --repeats 3    # quick look, ~1 min (the naive loop is most of it)
    .venv/bin/python benchmarks/multiturn.py --turns 8 --variants rollout,batched
    .venv/bin/python benchmarks/multiturn.py --model local/models/sft-tiny   # any local chat model folder

The same tiny tool model, prompts, turns and tokens, run four ways in one
process (CPU, float32, sdpa, `--threads` torch threads, OMP_WAIT_POLICY=PASSIVE
unless set otherwise):

  rollout  `rollout.rl.episode.run_episodes` over `EngineSampler(engine)`: every live episode's next turn
           goes to the engine in one `generate` call (one batch), as token ids: the prompt is rendered
           once, sampled ids are kept verbatim, only the env's answer is tokenised (`chat_tokens`);
  naive    the loop many scripts write: episode after episode, turn after turn,
           `engine.generate([messages])` with the whole message list: the engine re-applies the chat
           template, re-tokenises and re-prefills the conversation; the reply's text and the env's
           message are appended to the list;
  batched  the naive loop with every live episode's turn in one `engine.generate` call, still re-rendering
           the message lists each turn: it separates what batching buys from what token-level context buys;
  trl      `trl.GRPOTrainer(tools=[multiply])` generation (`_generate`: its tool-calling loop,
           `use_vllm=False`, plain `model.generate`), when the installed TRL's `GRPOTrainer` takes
           `tools=` (1.16.0 does); otherwise a line says why it is not compared.

Held equal: the model folder (a fresh `init_tiny_model`, ~1.05M params, or
`--model`); `--episodes` episodes = `--episodes / --generations` distinct prompts
("What is 123*45?") x `--generations` episodes each; the env (`FixedTurnsEnv`,
below): one tool (`multiply`, rendered in the system block of every prompt), and
after each assistant turn a `{"role": "tool", "content": "<a*b>"}` message, done
at turn `--turns` (never earlier, so every episode has exactly `--turns`
turns); sampling temperature 1, no top-k / top-p, exactly `--max-tokens` tokens
per turn (rollout: `SamplingParams(max_tokens=T, ignore_eos=True)`; TRL:
`max_new_tokens = min_new_tokens = T`), so every variant samples episodes x turns
x T tokens (asserted). Turn t of choice j of group g is seeded with
`derive_seed(seed, g, j, t)` in the rollout, naive and batched variants; TRL draws
from torch's global RNG. Repeat r uses seed `--seed + r`; the order of the
variants rotates every repeat; one untimed warm-up run of each variant (one
prompt group) comes first.

Timed: wall seconds of one whole run of all episodes (env resets included, the
engine's model loading and the TRL trainer's construction not); episodes/s =
episodes / seconds. Reported: min / median / max over repeats, the ratio of
medians rollout / variant, and "pairs" = the median of the per-repeat ratios
(each repeat runs the variants back to back, so it is steadier under a
changing load). Also per run: sampled tokens, prompt tokens (the summed prompt
length of every request the engine got: the re-prefill cost), and prefill
positions (what the prefill forwards computed: distinct prompts per call x the
call's longest prompt, since the engine left-pads a batch and prefills equal
prompts once; TRL: rows x longest prompt per `model.generate`).

What the hf engine reuses (so you know where the speed comes from): every turn
is a new `HFEngine.generate` call, but the rollout variant's requests carry the
episode's `cache_key` (`rl/episode.py`), so the engine keeps each episode's
key/value cache between turns and prefills only the last sampled token and the
env's answer (`inference/kept_cache.py`; "prefill tok" in the table); the naive,
batched and TRL variants prefill the whole context again each turn. Inside one
call, equal prompts are prefilled once (the `--generations` copies of a prompt at
turn 1) and all rows decode together. So rollout vs naive measures batching
(one forward per decode step for all live episodes instead of one per episode),
not re-rendering text and the kept caches; rollout vs batched measures what
token-level context and the kept caches save: rendering and tokenising every
conversation each turn (small: ~0.5 ms per conversation here), and the context
prefilled again. Each turn's engine call runs on the calling thread, as an
on-policy RL trainer's rounds do (`EngineSampler.rounds_on_caller_thread`). Prompt tokens
differ between variants because the context is built differently: rollout keeps
the sampled ids and closes an unfinished turn with `<|im_end|>`; TRL
concatenates ids without closing the turn; naive / batched re-tokenise the
decoded reply text (special tokens dropped), which with this random model comes
out ~25-45% longer than the sampled ids (byte-level fragments decode to U+FFFD,
3 bytes each), so they prefill ~15% more tokens per run -- and do not condition
on the tokens that were sampled. With a trained model that gap shrinks.

The TRL variant needs two things a random tiny model can't give: a chat
template that renders `tool_calls` (the tiny ChatML template is extended with
`<tool_call>{...}</tool_call>` rendering; TRL refuses templates without it), and
replies that call the tool (a random model never writes a well-formed call, and
TRL's loop only goes on while replies have tool calls). The benchmark sets a
response parser on TRL's tokenizer (`tokenizer.parse_response`, which TRL's
`parse_response` calls) that reads every reply as a call to `multiply(a, b)` of
the prompt's numbers, and `max_tool_calling_iterations = turns - 1`; the tool
result comes back as `{"role": "tool", "name": "multiply", "content": "<a*b>"}`,
the same message the env sends. Everything else -- prompt rendering, batched
`model.generate` per turn, the tool-suffix tokens, the concatenated context -- is
TRL's own code. TRL's generation is timed by calling `trainer._generate` on the
episodes' prompts (each repeated `--generations` times, as its sampler does),
without scoring or training.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench_common import no_activation_checkpointing, quiet_stderr

VARIANTS = ("rollout", "no-kv", "naive", "batched", "trl")


@dataclass(frozen=True)
class Run:
    """One timed run of all episodes by one variant."""

    seconds: float
    episodes: int
    sampled_tokens: int
    prompt_tokens: int
    prefill_tokens: int
    generate_calls: int

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=32, help="episodes per run (default 32)")
    p.add_argument(
        "--generations", type=int, default=4, help="episodes per distinct prompt (default 4; divides --episodes)"
    )
    p.add_argument("--turns", type=int, default=4, help="assistant turns per episode (default 4)")
    p.add_argument("--max-tokens", type=int, default=24, help="sampled tokens per turn, exactly (default 24)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant, interleaved (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--seed", type=int, default=0, help="repeat r samples with seed + r (default 0)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument(
        "--model", type=Path, default=None, help="a local chat model folder (default: a fresh init_tiny_model)"
    )
    args = p.parse_args(argv)
    for name in ("episodes", "generations", "turns", "max_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.episodes % args.generations:
        p.error("--generations must divide --episodes")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        p.error(f"--variants: choose from {', '.join(VARIANTS)}")
    if args.model is not None:
        if not (args.model / "config.json").is_file():
            p.error(f"--model {args.model}: not a model folder (no config.json)")
        args.model = args.model.resolve()
    return args


# --------------------------------------------------------------------------- the env (all variants)


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return str(a * b)


def make_rows(count: int) -> list[dict[str, Any]]:
    """`count` distinct questions with three- and two-digit factors."""
    rows = []
    for i in range(count):
        a, b = 101 + (i * 37) % 899, 11 + i % 89
        rows.append({"prompt": [{"role": "user", "content": f"What is {a}*{b}?"}], "a": a, "b": b})
    return rows


class FixedTurnsEnv:
    """Answers every assistant turn with the tool's result; done after exactly `turns` turns."""

    def __init__(self, turns: int) -> None:
        from rollout.rl.tools import tool_from_function

        self.turns = turns
        self.tools = [tool_from_function(multiply)]  # the prompt's system block lists it
        self.row: Mapping[str, Any] = {}
        self.steps = 0

    async def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        self.row, self.steps = row, 0
        return [dict(m) for m in row["prompt"]]

    async def step(self, assistant_message: Mapping[str, Any]) -> Any:
        from rollout.rl.types import StepResult

        self.steps += 1
        if self.steps >= self.turns:
            return StepResult(messages=(), reward=0.0, done=True)
        answer = {"role": "tool", "content": multiply(self.row["a"], self.row["b"])}
        return StepResult(messages=(answer,), reward=0.0, done=False, info={"tool_calls": 1})


def tool_schemas(turns: int) -> list[dict[str, Any]]:
    return [t.openai_schema() for t in FixedTurnsEnv(turns).tools]


# --------------------------------------------------------------------------- rollout's engine, counted


class CountingEngine:
    """An `HFEngine` that counts what each `generate` call prefilled and sampled; with `keep_caches=False`
    it drops the requests' `cache_key` (every turn prefills the whole conversation again)."""

    def __init__(self, engine: Any, *, keep_caches: bool = True) -> None:
        self.engine = engine
        self.keep_caches = keep_caches
        self.reset()

    def reset(self) -> None:
        self.calls = self.prompt_tokens = self.prefill_tokens = self.sampled_tokens = 0

    def generate(self, requests: Sequence[Any], params: Any = None) -> list[tuple[Any, ...]]:
        # all of a call's rows are admitted in one prefill (max_batch_size >= episodes), so this is exact
        assert len(requests) <= self.engine.max_batch_size, (len(requests), self.engine.max_batch_size)
        if not self.keep_caches:
            requests = [replace(r, cache_key=None) for r in requests]
        before = self.engine.kept_cache_stats["prefilled_tokens"]
        out = self.engine.generate(requests, params)
        prompts = [c.prompt_token_ids for choices in out for c in choices]
        self.calls += 1
        self.prompt_tokens += sum(map(len, prompts))
        self.prefill_tokens += self.engine.kept_cache_stats["prefilled_tokens"] - before
        self.sampled_tokens += sum(c.completion_tokens for choices in out for c in choices)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def sampling_params(args: argparse.Namespace, seed: int) -> Any:
    from rollout.inference.types import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=args.max_tokens, ignore_eos=True, seed=seed)


def run_rollout(engine: CountingEngine, rows: Sequence[Mapping[str, Any]], args: argparse.Namespace, seed: int) -> int:
    from rollout.inference.sampler import EngineSampler
    from rollout.rl.episode import EpisodeLimits, run_episodes

    sampler = EngineSampler(engine, max_batch=len(rows) * args.generations)
    # each turn's engine call on this thread, as an on-policy RL trainer's rounds run
    # (`rl_common.generate_on_training_thread`): one OpenMP team for every variant in this process
    sampler.rounds_on_caller_thread = True
    limits = EpisodeLimits(max_turns=args.turns, max_episode_tokens=engine.max_model_len)
    try:
        groups = asyncio.run(
            run_episodes(
                sampler, engine.tokenizer, lambda: FixedTurnsEnv(args.turns), list(enumerate(rows)),
                num_generations=args.generations, sampling=sampling_params(args, seed), seed=seed, limits=limits,
            )
        )
    finally:
        sampler.close()
    episodes = [e for group in groups for e in group]
    bad = [(e.finish_reason, e.num_turns, e.error) for e in episodes if e.finish_reason != "done" or e.num_turns != args.turns]
    assert not bad, f"rollout: episodes that did not run {args.turns} turns to 'done': {bad[:3]}"
    return len(episodes)


def run_naive(engine: CountingEngine, rows: Sequence[Mapping[str, Any]], args: argparse.Namespace, seed: int) -> int:
    """One episode at a time, one turn at a time, the whole message list re-rendered every turn."""
    from rollout.inference.types import GenerationRequest, derive_seed

    tools = tool_schemas(args.turns)
    base = sampling_params(args, seed)

    async def episodes() -> int:
        count = 0
        for g, row in enumerate(rows):
            for j in range(args.generations):
                env = FixedTurnsEnv(args.turns)
                messages = await env.reset(row)
                for t in range(args.turns):
                    params = replace(base, seed=derive_seed(seed, g, j, t))
                    request = GenerationRequest(prompt=list(messages), params=params, tools=tools)
                    [(reply,)] = engine.generate([request])
                    message = {"role": "assistant", "content": reply.text}
                    messages.append(message)
                    result = await env.step(message)
                    messages.extend(dict(m) for m in result.messages)
                    if result.done:
                        break
                assert env.steps == args.turns, (env.steps, args.turns)
                count += 1
        return count

    return asyncio.run(episodes())


def run_batched(engine: CountingEngine, rows: Sequence[Mapping[str, Any]], args: argparse.Namespace, seed: int) -> int:
    """Every live episode's turn in one `generate` call; message lists re-rendered every turn."""
    from rollout.inference.types import GenerationRequest, derive_seed

    tools = tool_schemas(args.turns)
    base = sampling_params(args, seed)

    async def episodes() -> int:
        keys = [(g, j) for g in range(len(rows)) for j in range(args.generations)]
        envs = [FixedTurnsEnv(args.turns) for _ in keys]
        conversations = await asyncio.gather(*(env.reset(rows[g]) for env, (g, _) in zip(envs, keys, strict=True)))
        live = list(range(len(keys)))
        for t in range(args.turns):
            requests = [
                GenerationRequest(
                    prompt=list(conversations[i]), params=replace(base, seed=derive_seed(seed, *keys[i], t)), tools=tools
                )
                for i in live
            ]
            outputs = engine.generate(requests)
            messages = [{"role": "assistant", "content": choices[0].text} for choices in outputs]
            results = await asyncio.gather(*(envs[i].step(m) for i, m in zip(live, messages, strict=True)))
            for i, message, result in zip(live, messages, results, strict=True):
                conversations[i].append(message)
                conversations[i].extend(dict(m) for m in result.messages)
            live = [i for i, result in zip(live, results, strict=True) if not result.done]
            if not live:
                break
        assert not live and all(env.steps == args.turns for env in envs)
        return len(keys)

    return asyncio.run(episodes())


# --------------------------------------------------------------------------- TRL


TOOL_CALLS_JINJA = (
    "{{- message['content'] -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
)


@dataclass
class TrlCounts:
    """What TRL's `model.generate` calls prefilled and sampled (the `CountingEngine` counters)."""

    calls: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    sampled_tokens: int = 0

    def reset(self) -> None:
        self.calls = self.prompt_tokens = self.prefill_tokens = self.sampled_tokens = 0


def setup_trl(
    model_dir: Path, work: Path, rows: Sequence[Mapping[str, Any]], opening: Sequence[int], args: argparse.Namespace
) -> tuple[Callable[[int], int] | None, TrlCounts, str]:
    """(run(seed) -> episodes, its counters, a line about the setup) or (None, _, why TRL is not compared)."""
    counts = TrlCounts()
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        return None, counts, f"TRL not compared: trl is not installed ({err}); install the [bench] extra"
    version = f"trl {trl.__version__}"
    if "tools" not in inspect.signature(GRPOTrainer.__init__).parameters:
        return None, counts, f"TRL not compared: {version} GRPOTrainer has no tools= argument (no multi-turn loop)"
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.models.tiny import CHAT_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assistant = "{{- message['content'] + '<|im_end|>' -}}"
    if tokenizer.chat_template == CHAT_TEMPLATE and assistant in CHAT_TEMPLATE:
        tokenizer.chat_template = CHAT_TEMPLATE.replace(assistant, TOOL_CALLS_JINJA)

    questions: dict[tuple[int, ...], tuple[int, int]] = {}  # each row's rendered prompt ids -> its factors

    def forced_parse(ids: Sequence[int], prefix: Sequence[int] | None = None, tools: Any = None) -> dict[str, Any]:
        """Every reply calls multiply(a, b) of its prompt's question (a random model never writes a call)."""
        prefix = list(prefix or ())
        factors = next((ab for p, ab in questions.items() if tuple(prefix[: len(p)]) == p), None)
        assert factors is not None, "the parsed reply's prefix does not start with a known prompt"
        call = {"name": "multiply", "arguments": {"a": factors[0], "b": factors[1]}}
        text = tokenizer.decode(list(ids), skip_special_tokens=True)
        return {"role": "assistant", "content": text, "tool_calls": [{"type": "function", "function": call}]}

    tokenizer.parse_response = forced_parse  # what trl's parse_response calls (with prefix= and tools=)
    tokenizer.response_template = {"benchmark": "every reply is a call to multiply"}  # any non-None: TRL parses

    episodes = len(rows) * args.generations
    config = GRPOConfig(
        output_dir=str(work / "trl"),
        per_device_train_batch_size=episodes,
        num_generations=args.generations,
        max_completion_length=args.turns * (args.max_tokens + 64),  # the whole episode's budget: never truncates
        max_tool_calling_iterations=args.turns - 1,
        generation_kwargs={"max_new_tokens": args.max_tokens, "min_new_tokens": args.max_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=False,
        beta=0.0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **no_activation_checkpointing(GRPOConfig),
    )
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    try:
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=config,
            train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in rows]),
            processing_class=tokenizer,
            tools=[multiply],
        )
    except (ValueError, ImportError, TypeError) as err:
        return None, counts, f"TRL not compared: {version} GRPOTrainer(tools=[multiply]) refused the tiny model: {err}"
    for row, ids in zip(rows, trainer._tokenize_prompts([r["prompt"] for r in rows])[0], strict=True):
        questions[tuple(ids)] = (row["a"], row["b"])
    gen = trainer.generation_config
    assert gen.do_sample and gen.temperature == 1.0 and gen.top_p == 1.0 and gen.top_k in (0, None), gen
    assert gen.max_new_tokens == gen.min_new_tokens == args.max_tokens, gen
    generate = trainer._generate_single_turn

    def counted_generate(prompt_ids: list[list[int]], *a: Any, **kw: Any) -> Any:
        completion_ids, logprobs = generate(prompt_ids, *a, **kw)
        counts.calls += 1
        counts.prompt_tokens += sum(map(len, prompt_ids))
        counts.prefill_tokens += sum(map(len, prompt_ids))  # every row's prompt: generate prefills each
        counts.sampled_tokens += sum(map(len, completion_ids))
        return completion_ids, logprobs

    trainer._generate_single_turn = counted_generate  # type: ignore[method-assign]
    prompts = [r["prompt"] for r in rows for _ in range(args.generations)]

    def run(seed: int) -> int:
        torch.manual_seed(seed)
        # what `_generate_and_score_completions` builds before generating: each rollout's tool table
        trainer._sync_tool_dicts = [{"multiply": multiply} for _ in prompts]
        trainer._async_tool_dicts = [{} for _ in prompts]
        _, completion_ids, tool_mask, completions, *_ = trainer._generate(copy.deepcopy(prompts))
        turns = [sum(m["role"] == "assistant" for m in c) for c in completions]
        assert all(n == args.turns for n in turns), f"TRL episodes with other than {args.turns} turns: {turns}"
        return len(completion_ids)

    same = list(trainer._tokenize_prompts([rows[0]["prompt"]])[0][0]) == list(opening)
    return run, counts, (
        f"{version}: GRPOTrainer(tools=[multiply]) with a forced tool-call parser (see docstring); "
        f"opening prompt ids {'the same as' if same else 'DIFFERENT from'} rollout's"
    )


# --------------------------------------------------------------------------- main


def print_header(args: argparse.Namespace, model: str) -> None:
    import platform

    import torch
    import transformers

    import rollout

    try:
        import trl

        trl_version = f"trl {trl.__version__}"
    except ImportError:
        trl_version = "trl not installed"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    prompts = args.episodes // args.generations
    print(f"Multi-turn episodes/s: rollout episode loop vs naive re-prefill vs batched re-render vs TRL ({model}, CPU)")
    print(
        f"  versions: rollout {rollout.__version__}, {trl_version}, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, python {platform.python_version()}"
    )
    print(
        f"  {args.episodes} episodes = {prompts} prompts x {args.generations}, {args.turns} turns x exactly "
        f"{args.max_tokens} sampled tokens, tool answer after every turn but the last; temperature 1, "
        f"float32, sdpa, threads {args.threads}, repeats {args.repeats} (seed {args.seed} + r); cpus "
        f"{os.cpu_count()}, load avg {load}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    load1, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load1 > cpus - 0.5:
        print(f"  note: load average {load1:.1f} on {cpus} cpus: slower and noisier than on an idle machine")
    print(flush=True)


def print_table(results: dict[str, list[Run]], args: argparse.Namespace) -> None:
    ref = results.get("rollout")
    print()
    print(
        f"{'variant':<8} | {'episodes/s min / median / max':>29} | {'s/run':>6} | {'rollout/this':>12} | "
        f"{'pairs':>6} | {'sampled tok':>11} | {'prompt tok':>10} | {'prefill tok':>11} | {'generate calls':>14}"
    )
    print("-" * 131)
    for name, runs in results.items():
        eps = [r.episodes_per_s for r in runs]
        ratio = pairs = "-"
        if ref is not None:
            ratio = f"{statistics.median(r.episodes_per_s for r in ref) / statistics.median(eps):.2f}x"
            pairs = f"{statistics.median(a.episodes_per_s / b.episodes_per_s for a, b in zip(ref, runs, strict=True)):.2f}x"
        last = runs[-1]
        print(
            f"{name:<8} | {min(eps):>8.2f} / {statistics.median(eps):>7.2f} / {max(eps):>8.2f} | "
            f"{statistics.median(r.seconds for r in runs):>6.3f} | {ratio:>12} | {pairs:>6} | "
            f"{last.sampled_tokens:>11,} | {last.prompt_tokens:>10,} | {last.prefill_tokens:>11,} | "
            f"{last.generate_calls:>14,}"
        )
    print(
        "\nrollout/this = median episodes/s of rollout / this variant's; pairs = median of the per-repeat ratios;"
        "\ntoken columns are the last repeat's: prompt tok = summed prompt length of every request (the re-prefill"
        " cost),\nprefill tok = prompt tokens the prefill forwards computed (padding not counted; the engine prefills"
        " equal prompts once and,\nfor rollout, only what follows a kept cache)"
    )
    print(f"load avg at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP: before importing torch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    print_header(args, str(args.model) if args.model else "tiny Qwen2 ~1.05M params, init_tiny_model")

    rows = make_rows(args.episodes // args.generations)
    with tempfile.TemporaryDirectory(prefix="multiturn-") as tmp:
        runners = prepare_variants(args, Path(tmp), rows)
        results: dict[str, list[Run]] = {name: [] for name in runners}
        names = list(runners)
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]  # rotate: a load change hits all
            for name in order:
                run = runners[name].timed(rows, args.seed + repeat)
                results[name].append(run)
                print(
                    f"repeat {repeat + 1}/{args.repeats} {name:<8} {run.episodes_per_s:8.2f} episodes/s "
                    f"({run.seconds:.3f}s; {run.generate_calls} generate calls, {run.prompt_tokens:,} prompt tokens, "
                    f"{run.sampled_tokens:,} sampled), load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    print_table(results, args)
    return 0


@dataclass
class Variant:
    """One way of running the episodes, with the counter of what it prefilled and sampled."""

    name: str
    run: Callable[[Sequence[Mapping[str, Any]], int], int]
    counter: CountingEngine | TrlCounts
    args: argparse.Namespace

    def timed(self, rows: Sequence[Mapping[str, Any]], seed: int) -> Run:
        """One timed run of every episode (`seed`); checks every episode ran and sampled its tokens."""
        self.counter.reset()
        t0 = time.perf_counter()
        with quiet_stderr():
            done = self.run(rows, seed)
        seconds = time.perf_counter() - t0
        a = self.args
        expected = a.episodes * a.turns * a.max_tokens
        assert done == a.episodes, (self.name, done, a.episodes)
        assert self.counter.sampled_tokens == expected, (
            f"{self.name} sampled {self.counter.sampled_tokens} tokens, expected {a.episodes} x {a.turns} x "
            f"{a.max_tokens} = {expected}"
        )
        c = self.counter
        return Run(seconds, done, c.sampled_tokens, c.prompt_tokens, c.prefill_tokens, c.calls)


def prepare_variants(args: argparse.Namespace, work: Path, rows: Sequence[Mapping[str, Any]]) -> dict[str, Variant]:
    """The model (in `work` unless `--model`), the engine and TRL's trainer, each variant warmed up once.
    Also used by `run_all.py` (`make bench`)."""
    import torch

    from rollout.inference.hf_engine import load_hf_engine
    from rollout.rl.chat_tokens import prompt_ids

    model_dir = args.model
    if model_dir is None:
        from rollout.models.tiny import init_tiny_model

        model_dir = init_tiny_model(work / "tiny")
    with quiet_stderr():
        engine = CountingEngine(load_hf_engine(model_dir, device="cpu", max_batch_size=max(32, args.episodes)))
    no_kv = CountingEngine(engine.engine, keep_caches=False)
    opening = prompt_ids(engine.tokenizer, rows[0]["prompt"], tools=tool_schemas(args.turns))
    assert tuple(opening) == engine.engine.tokenize(rows[0]["prompt"], tool_schemas(args.turns))
    print(f"opening prompt: {len(opening)} tokens, {engine.tokenizer.decode(opening)!r}")

    variants: dict[str, Variant] = {}
    for name, fn, counter in (
        ("rollout", run_rollout, engine), ("no-kv", run_rollout, no_kv), ("naive", run_naive, engine),
        ("batched", run_batched, engine),
    ):
        if name in args.variants:
            run = lambda rs, seed, fn=fn, counter=counter: fn(counter, rs, args, seed)  # noqa: E731
            variants[name] = Variant(name, run, counter, args)
    if "trl" in args.variants:
        with quiet_stderr():
            trl_run, trl_counts, line = setup_trl(model_dir, work, rows, opening, args)
        torch.set_num_threads(args.threads)
        print(line)
        if trl_run is not None:
            # TRL's trainer holds the full prompt list; the warm-up below runs all of it
            variants["trl"] = Variant("trl", lambda rs, seed: trl_run(seed), trl_counts, args)
    print(flush=True)
    for variant in variants.values():  # one prompt group each (TRL: the whole batch)
        with quiet_stderr():
            variant.run(rows[:1], args.seed - 1)
    return variants


if __name__ == "__main__":
    sys.exit(main())
