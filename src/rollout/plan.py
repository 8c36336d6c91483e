"""`rollout plan`: every check that can be made before training starts (SPEC principle 1).

    plan = make_plan(Path("examples/sft-tiny.toml"))    # RolloutError (exit 2) on the first problem
    plan.lengths, plan.memory, plan.plugins, plan.warnings
    write_lock(plan.lock(), Path("plan.lock"))          # rollout.plan_lock
    cfg, drift = check_lock(Path("plan.lock"))           # what `rollout run --plan` refuses on

Top to bottom, `make_plan` does what `rollout validate` does (config, backend, every dataset
line, `[eval]`), then:

1. loads the tokenizer and reads the model's config.json and safetensors headers (no weights);
2. tokenises every line as the algorithm will (`rollout.data.tokenize`: the chat template with
   the line's tools and the `loss_on` mode; RL prompts with `add_generation_prompt` and the env's
   tools), locating a line the template can't render (`file:17: ...`), and reports the length
   percentiles and how many sequences exceed `packing.max_seq_len` (truncated for SFT, RM, DPO
   and KTO; reported for RL, whose prompt + completion the limit bounds);
3. resolves every reward function, env, tool and sidecar and checks their signatures against
   the data (a sidecar is started and must answer `describe` with the kind it is used as);
4. estimates the peak memory (`rollout.plan_memory`) and refuses a run that can't fit the device;
5. digests every file the run reads and records package versions (`rollout.plan_lock`).

The model checks need transformers; without it (a build without the torch extra) they are
skipped with a warning, as SPEC section 7 allows. torch itself is imported only to ask whether
CUDA is there when `backend.device` is not "cpu".
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from rollout import __version__
from rollout.algorithms.config import (
    DPOConfig,
    EpisodeEnvConfig,
    GRPOConfig,
    KTOConfig,
    PPOConfig,
    RewardModelSpec,
    RLCommon,
    SidecarRewardSpec,
    TrainCommon,
)
from rollout.algorithms.registry import ALGORITHMS, BUILTIN_ALGORITHMS
from rollout.config import RunConfig, load_config
from rollout.config_base import located_error
from rollout.data.jsonl import DataReport, Row
from rollout.data.prepared import Encoded, encode_lines, leave_prepared, prepared_key
from rollout.data.sources import read_dataset
from rollout.data.tokenize import cut_pairs, cut_samples
from rollout.errors import ConfigError, DataError, RolloutError
from rollout.plan_lock import (
    LOCK_VERSION,
    PinnedFile,
    digest_files,
    files_to_pin,
    is_under,
    local_model_dir,
    package_versions,
)
from rollout.plan_memory import (
    DeviceInfo,
    Generation,
    MemoryEstimate,
    ModelShape,
    TrainPass,
    Workload,
    estimate_memory,
    format_bytes,
    probe_device,
    read_model_shape,
)
from rollout.sidecar_config import SidecarConfig

_UNTRUNCATED = sys.maxsize
"""max_seq_len handed to the tokenizers so they keep every token: plan counts the overflow itself."""
T = TypeVar("T")


@dataclass(frozen=True)
class LengthReport:
    """Token lengths of the dataset as the algorithm tokenises it."""

    what: str
    """"sequences" (SFT, KTO), "pairs" (RM, DPO: the longer side) or "prompts" (RL)."""
    count: int
    percentiles: dict[str, int]
    """p50, p90, p99, max."""
    max_seq_len: int
    over: int
    """Sequences longer than max_seq_len (RL: prompt + max completion)."""
    action: str
    """"truncated" (the first max_seq_len tokens are kept) or "reported" (RL: nothing is cut)."""
    dropped: int
    """Samples left without a loss token (before or after truncation): not trained on."""
    total_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {"what": self.what, "count": self.count, **self.percentiles, "max_seq_len": self.max_seq_len,
                "over_max_seq_len": self.over, "action": self.action, "dropped": self.dropped,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True)
class PluginCheck:
    """A reward function, env, tool or sidecar the run uses, resolved and checked."""

    role: str
    name: str
    origin: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "name": self.name, "origin": self.origin, "detail": self.detail}


@dataclass(frozen=True)
class Plan:
    config_path: Path
    config: RunConfig
    data: DataReport
    lengths: LengthReport | None
    plugins: tuple[PluginCheck, ...]
    model: ModelShape | None
    memory: MemoryEstimate | None
    device: DeviceInfo
    files: tuple[PinnedFile, ...]
    packages: dict[str, str]
    warnings: tuple[str, ...]

    def lock(self) -> dict[str, Any]:
        """The lock file's content (docs/plan-lock.md)."""
        return {
            "lock_version": LOCK_VERSION,
            "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "rollout_version": __version__,
            "config_path": str(self.config_path.resolve()),
            "config_digest": self.config.digest(),
            "algorithm": self.config.algorithm.kind,
            "config": self.config.model_dump(mode="json"),
            "files": [f.to_dict() for f in self.files],
            "packages": dict(self.packages),
            "device": self.device.to_dict(),
            "data": {"source": self.data.label, "lines": self.data.num_lines, "valid": self.data.num_valid,
                     "skipped": self.data.num_skipped},
            "lengths": self.lengths.to_dict() if self.lengths else None,
            "model": self.model.to_dict() if self.model else None,
            "plugins": [p.to_dict() for p in self.plugins],
            "estimate": self.memory.to_dict() if self.memory else None,
            "warnings": list(self.warnings),
        }


def make_plan(
    config_path: Path, *, config: RunConfig | None = None, produced: Sequence[Path] = (), pin: bool = True,
    hand_off: bool = False,
) -> Plan:
    """Every plan-time check of the run config at `config_path` (module docstring).

    A pipeline stage (`rollout.pipeline`) passes its `config` already loaded, with stand-ins for
    the models earlier stages will produce, and those stand-ins' folders as `produced`: their
    files are checked but not pinned. `pin=False` (`rollout train`, which writes no lock) skips
    step 5's digests: the plan's `files` is empty. `hand_off=True` (`rollout train`, whose recipe
    runs next in this process) leaves the rows read and tokenised here for it (`rollout.data.prepared`)."""
    from rollout.cli.config_cmds import check_dataset_files, check_eval, check_model_path, check_runtime

    config_path = Path(config_path)
    cfg = config if config is not None else load_config(config_path)
    check_runtime(cfg, source=config_path)
    s = cfg.algorithm.settings
    spec = ALGORITHMS[cfg.algorithm.kind]
    check_dataset_files(cfg, source=config_path)
    rows, report = read_dataset(s.dataset, spec.data_kind)
    if not rows:
        raise DataError(f"{report.label}: no valid lines")
    check_eval(cfg, source=config_path)
    check_model_path(cfg)
    _check_budget(cfg, config_path)
    warnings: list[str] = []
    if report.num_skipped:
        warnings.append(f"{report.label}: {report.num_skipped} bad lines skipped (on_bad_line = \"skip\")")

    plugins, tool_schemas = check_plugins(cfg, rows)
    tokenizer = _load_tokenizer(cfg, warnings)
    shape = lengths = memory = None
    device = probe_device(cfg.backend.device)
    encoded = None
    if tokenizer is not None:
        shape = read_model_shape(local_model_dir(s.base_model.uri, s.base_model.revision))
        lengths, encoded = measure_lengths(cfg, rows, tokenizer, tool_schemas)
        warnings += _length_warnings(cfg, lengths, shape)
        _check_enough_samples(cfg, lengths, config_path)
        memory = estimate_memory(build_workload(cfg, shape, lengths), device=device.kind)
        warnings += check_memory(cfg, memory, device, config_path)
    files = digest_files(
        f for f in files_to_pin(cfg, config_path=config_path) if not is_under(f[0], produced)
    ) if pin else []
    if hand_off:
        leave_prepared(prepared_key(s.dataset, spec.data_kind, model=s.base_model, loss_on=_loss_on(cfg)),
                       rows, report, encoded)
    return Plan(config_path, cfg, report, lengths, tuple(plugins), shape, memory, device, tuple(files),
                package_versions(), tuple(warnings))


def _load_tokenizer(cfg: RunConfig, warnings: list[str]) -> Any:
    try:
        import transformers  # noqa: F401
    except ImportError:
        warnings.append("transformers is not installed: tokenizer, lengths and memory checks skipped")
        return None
    from rollout.models.load import ModelSource, load_tokenizer

    return load_tokenizer(ModelSource(**cfg.algorithm.settings.base_model.model_dump()))


def _check_budget(cfg: RunConfig, source: Path) -> None:
    s = cfg.algorithm.settings
    if isinstance(s, RLCommon) and s.budget.max_steps is None:
        raise located_error(source, ["algorithm", cfg.algorithm.kind, "budget"],
                            f"{cfg.algorithm.kind} needs budget.max_steps (epochs and tokens are not defined"
                            " for sampled data)")


# --------------------------------------------------------------------------- lengths


def measure_lengths(
    cfg: RunConfig, rows: list[Row], tokenizer: Any, tool_schemas: list[dict]
) -> tuple[LengthReport, Encoded | None]:
    """Tokenise every row as the algorithm will and count what exceeds `packing.max_seq_len`;
    with the full-length tokens of sft, kto and preference lines (the recipe cuts them)."""
    s = cfg.algorithm.settings
    limit = s.packing.max_seq_len
    kind = ALGORITHMS[cfg.algorithm.kind].data_kind
    if kind in ("sft", "kto"):
        encoded = _tokenize_located(rows, lambda rs: encode_lines(rs, kind, tokenizer, loss_on=_loss_on(cfg)))
        samples, stats, _ = cut_samples(encoded, _UNTRUNCATED)
        lengths = [len(x.input_ids) for x in samples]
        lost = sum(1 for x in samples if len(x.input_ids) > limit and not any(x.loss_mask[1:limit]))
        return _report("sequences", lengths, limit, "truncated", stats.num_dropped + lost), encoded
    if kind == "preference":
        encoded = _tokenize_located(rows, lambda rs: encode_lines(rs, kind, tokenizer, loss_on=None))
        pairs, stats, _ = cut_pairs(encoded, _UNTRUNCATED)
        lengths = [max(len(p.chosen_ids), len(p.rejected_ids)) for p in pairs]
        lost = sum(1 for p in pairs if _pair_lost(p, limit))
        return _report("pairs", lengths, limit, "truncated", stats.num_dropped + lost), encoded
    prompt_lengths = _tokenize_located(rows, lambda rs: _prompt_lengths(rs, tokenizer, tool_schemas))
    completion = _max_completion(s)
    over = sum(1 for n in prompt_lengths if n + completion > limit)
    report = _report("prompts", prompt_lengths, limit, "reported", 0)
    return LengthReport(report.what, report.count, report.percentiles, limit, over, "reported", 0,
                        report.total_tokens), None


def _loss_on(cfg: RunConfig) -> str | None:
    """The `loss_on` the recipe tokenises its lines with (None: preference and prompt lines)."""
    kind = ALGORITHMS[cfg.algorithm.kind].data_kind
    if kind == "kto":
        return "completion"
    return cfg.algorithm.settings.loss_on.kind if kind == "sft" else None


def _report(what: str, lengths: list[int], limit: int, action: str, dropped: int) -> LengthReport:
    ordered = sorted(lengths)
    return LengthReport(
        what, len(ordered), {name: _percentile(ordered, q) for name, q in (("p50", 50), ("p90", 90), ("p99", 99))}
        | {"max": ordered[-1] if ordered else 0}, limit, sum(1 for n in ordered if n > limit), action, dropped,
        sum(min(n, limit) for n in ordered),
    )


def _percentile(ordered: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of sorted values."""
    if not ordered:
        return 0
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _pair_lost(pair: Any, limit: int) -> bool:
    """`tokenize_pairs`' rule, after cutting both sides to `limit`: a side left without an answer
    token, or both sides the same."""
    c, r = pair.chosen_ids[:limit], pair.rejected_ids[:limit]
    return len(c) <= min(pair.prompt_len_chosen, limit) or len(r) <= min(pair.prompt_len_rejected, limit) or c == r


def _prompt_lengths(rows: list[Row], tokenizer: Any, tool_schemas: list[dict]) -> list[int]:
    """Prompt tokens as the engine renders them: text as is, messages through the chat template
    with the generation prompt (and the env's tools)."""
    out = []
    for row in rows:
        prompt = row.data["prompt"]
        if isinstance(prompt, str):
            out.append(len(tokenizer(prompt, add_special_tokens=True)["input_ids"]))
            continue
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{row.location}: a message-list prompt needs a chat template, and the tokenizer has none")
        rendered = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, tools=tool_schemas or None, return_dict=True)
        out.append(len(rendered["input_ids"]))
    return out


def _tokenize_located(rows: list[Row], tokenize: Callable[[list[Row]], T]) -> T:
    """`tokenize(rows)`, with a chat template's own exception (a jinja `raise_exception`, a bad
    message shape) pinned to the line that raised it."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "sequence length is longer than the maximum": plan counts it
    try:
        try:
            return tokenize(rows)
        except RolloutError:
            raise
        except Exception as err:  # the template raised: find the line
            for row in rows:
                try:
                    tokenize([row])
                except RolloutError:
                    raise
                except Exception as row_err:
                    raise DataError(
                        f"{row.location}: the chat template can't render this line: {_first_line(row_err)}"
                    ) from None
            raise DataError(f"the chat template failed on the dataset: {_first_line(err)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def _max_completion(s: TrainCommon) -> int:
    if isinstance(s, RLCommon):
        return s.env.max_episode_tokens if isinstance(s.env, EpisodeEnvConfig) else s.max_tokens
    return 0


def _length_warnings(cfg: RunConfig, lengths: LengthReport, shape: ModelShape) -> list[str]:
    out = []
    s = cfg.algorithm.settings
    if lengths.over and lengths.action == "reported":
        out.append(f"{lengths.over} of {lengths.count} prompts + max completion ({_max_completion(s)}) exceed"
                   f" packing.max_seq_len {lengths.max_seq_len}")
    longest = min(lengths.percentiles["max"], lengths.max_seq_len) + _max_completion(s)
    if shape.max_position_embeddings and longest > shape.max_position_embeddings:
        out.append(f"sequences of up to {longest} tokens exceed the model's max_position_embeddings"
                   f" ({shape.max_position_embeddings})")
    return out


def _check_enough_samples(cfg: RunConfig, lengths: LengthReport, source: Path) -> None:
    s = cfg.algorithm.settings
    kept = lengths.count - lengths.dropped
    if kept == 0:
        raise DataError(f"no trainable samples: all {lengths.count} {lengths.what} are left without a loss token"
                        f" at max_seq_len {lengths.max_seq_len}")
    if lengths.what != "prompts" and s.packing.kind == "off" and kept < s.minibatch_size:
        raise located_error(source, ["algorithm", cfg.algorithm.kind, "minibatch_size"],
                            f"{kept} trainable samples make no full micro-batch of {s.minibatch_size}")


# --------------------------------------------------------------------------- plugins


def check_plugins(cfg: RunConfig, rows: list[Row]) -> tuple[list[PluginCheck], list[dict]]:
    """Resolve every reward function, env, tool and sidecar of the run and check each against
    the data; also the OpenAI schemas of the tools the prompts are rendered with."""
    from rollout.plugins import find_plugin

    s = cfg.algorithm.settings
    checks: list[PluginCheck] = []
    tool_schemas: list[dict] = []
    kind = cfg.algorithm.kind
    if kind not in BUILTIN_ALGORITHMS:
        plugin = find_plugin("algorithm", kind)
        checks.append(PluginCheck("algorithm", kind, plugin.where if plugin else "?", ALGORITHMS[kind].train))
    if not isinstance(s, RLCommon):
        return checks, tool_schemas
    fields = sorted({key for row in rows for key in row.data if key != "prompt"})
    for entry in s.rewards:
        if isinstance(entry, RewardModelSpec):
            where = (str(entry.model) if entry.model is not None else f"served at {entry.url}" if entry.url
                     else f"snapshot {entry.snapshot}")
            checks.append(PluginCheck("reward", entry.name, "reward_model", where))
        elif isinstance(entry, SidecarRewardSpec):
            checks.append(_check_sidecar(entry, "reward", entry.label))
        else:
            checks.append(_check_reward_function(entry.name, fields))
    if isinstance(s.env, str):
        checks.append(_check_env(s.env, {}, fields))
    elif isinstance(s.env, EpisodeEnvConfig):
        env = s.env
        if isinstance(env.name, SidecarConfig):
            check = _check_sidecar(env.name, "env", env.name.label)
            checks.append(check)
            from rollout.sidecar import Sidecar
            from rollout.sidecar import tool_schemas as sidecar_tool_schemas

            tool_schemas += [t.openai_schema() for t in sidecar_tool_schemas(Sidecar.from_config(env.name)
                                                                              .describe_blocking())]
        else:
            options = dict(env.options) | ({"tools": []} if env.tools else {})
            checks.append(_check_env(env.name, options, fields))
        if env.tools:
            from rollout.rl.tools import resolve_tools

            for tool_ref in env.tools:
                if isinstance(tool_ref, SidecarConfig):
                    checks.append(_check_sidecar(tool_ref, "tool", tool_ref.label))
            tools = resolve_tools(env.tools)
            tool_schemas += [t.openai_schema() for t in tools]
            checks += [PluginCheck("tool", t.name, "resolved", _signature_words(t.parameters)) for t in tools]
    return checks, tool_schemas


def _check_reward_function(name: str, fields: list[str]) -> PluginCheck:
    from rollout.rl.rewards import resolve_reward

    fn = resolve_reward(name)
    problem = _reward_signature_problem(fn, fields)
    if problem is not None:
        raise ConfigError(f"reward function {name!r}: {problem}")
    return PluginCheck("reward", name, _origin("reward", name), f"{_callable_words(fn)}; fields: {', '.join(fields) or '-'}")


def _reward_signature_problem(fn: Any, fields: list[str]) -> str | None:
    """A reward function is called `fn(prompts, completions, **fields)` with the dataset's other
    columns as keyword lists; every parameter it requires must be one of them."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C callable: can't tell, the first batch will say
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return f"must take (prompts, completions, **fields), its signature is {sig}"
    required = [p.name for p in (positional[2:] + [p for p in params if p.kind is p.KEYWORD_ONLY])
                if p.default is p.empty]
    missing = [name for name in required if name not in fields]
    if missing:
        have = ", ".join(fields) or "none"
        return f"requires {', '.join(missing)}, which the dataset lines don't have (their fields: {have})"
    return None


def _check_env(name: str, options: dict[str, Any], fields: list[str]) -> PluginCheck:
    from rollout.rl.envs import resolve_env

    factory = resolve_env(name)
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        try:
            sig.bind(**options)
        except TypeError as err:
            raise ConfigError(f"env {name!r}: its factory {sig} can't take the options"
                              f" {sorted(options)}: {err}") from None
    if inspect.isclass(factory):
        missing = [m for m in ("reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            raise ConfigError(f"env {name!r}: {factory.__name__} has no {' or '.join(missing)} method")
    return PluginCheck("env", name, _origin("env", name), f"{_callable_words(factory)}; fields: {', '.join(fields) or '-'}")


def _check_sidecar(sidecar: SidecarConfig, kind: str, label: str) -> PluginCheck:
    """Start the sidecar and ask `describe` (a separate process, stopped after); it must list `kind`."""
    import shlex

    from rollout.sidecar import Sidecar

    info = Sidecar.from_config(sidecar).describe_blocking()
    if kind not in info["kinds"]:
        raise ConfigError(f'sidecar "{shlex.join(sidecar.command)}" is used as a {kind} but its describe lists'
                          f" kinds {info['kinds']}")
    tools = [t.get("function", t).get("name") for t in info.get("tools", []) if isinstance(t, dict)]
    detail = f"describe: {info.get('name', '?')} kinds={','.join(info['kinds'])}" + (
        f" tools={','.join(map(str, tools))}" if tools else "")
    return PluginCheck(kind, label, shlex.join(sidecar.command), detail)


def _origin(kind: str, name: str) -> str:
    from rollout.plugins import find_plugin

    plugin = find_plugin(kind, name)  # type: ignore[arg-type]
    return plugin.where if plugin is not None else name


def _callable_words(fn: Any) -> str:
    """`name(prompts, completions, answer=None, **_)`: the signature without annotations."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return name
    bare = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)
    return f"{name}{bare}"


def _signature_words(parameters: dict[str, Any]) -> str:
    props = parameters.get("properties", {})
    return "(" + ", ".join(f"{k}: {v.get('type', '?')}" for k, v in props.items()) + ")"


# --------------------------------------------------------------------------- memory


def build_workload(cfg: RunConfig, shape: ModelShape, lengths: LengthReport) -> Workload:
    """The run's models and its largest micro-batch, as `rollout.plan_memory` counts them."""
    s = cfg.algorithm.settings
    kind = cfg.algorithm.kind
    longest = min(lengths.percentiles["max"], lengths.max_seq_len)
    trainable = shape.lora_params(s.lora.r, s.lora.target_modules) if s.lora is not None else shape.num_params
    optimizer = s.optimizer
    states = 2 if optimizer.kind == "adamw" else (1 if optimizer.momentum > 0 else 0)
    generation = engine = value = reference = None
    reward_models: tuple[ModelShape, ...] = ()
    if isinstance(s, RLCommon):
        completion = _max_completion(s)
        seqs = s.minibatch_size * s.num_generations
        per_micro = math.ceil(seqs / s.gradient_accumulation)
        prompts_per_micro = min(s.minibatch_size, per_micro)
        train = TrainPass(per_micro, prompts_per_micro * longest + per_micro * completion, per_micro * completion)
        batch = cfg.inference.max_batch_size if cfg.inference is not None else 256
        generation = Generation(min(seqs, batch), longest + completion)
        engine = shape if cfg.inference is None or cfg.inference.engine == "hf" else None
        value = shape if isinstance(s, PPOConfig) else None
        uses_reference = (isinstance(s, GRPOConfig) and s.beta > 0) or (isinstance(s, PPOConfig) and s.kl_coef > 0)
        reward_models = tuple(_reward_model_shape(e, shape) for e in s.rewards  # a served RM is not in this process
                              if isinstance(e, RewardModelSpec) and e.url is None)
    else:
        rows_per_micro = s.minibatch_size * (2 if kind in ("rm", "dpo", "kto") else 1)
        if s.packing.kind == "off":  # padded to the longest row of the batch: at worst the longest sample
            tokens = rows_per_micro * longest
        else:  # packed rows of max_seq_len, at most the whole dataset
            tokens = min(rows_per_micro * s.packing.max_seq_len, lengths.total_tokens)
        train = TrainPass(rows_per_micro, tokens, 0 if kind == "rm" else tokens)
        uses_reference = isinstance(s, DPOConfig | KTOConfig) and not s.reference.precompute
    if uses_reference:
        ref_uri = s.reference.uri or s.base_model.uri  # type: ignore[attr-defined]
        adapter = s.lora is not None and ref_uri == s.base_model.uri
        if not adapter:
            reference = shape if ref_uri == s.base_model.uri else read_model_shape(local_model_dir(ref_uri, None))
    datasets = s.dataset.sources if s.dataset.kind == "mixture" else (s.dataset,)
    file_bytes = sum(p.stat().st_size for src in datasets if src.path is not None
                     for p in ([src.path] if src.path.is_file() else src.path.rglob("*")) if p.is_file())
    return Workload(
        algorithm=kind, policy=shape, dtype=s.base_model.dtype, trainable_params=trainable, optimizer_states=states,
        train=train, data_file_bytes=file_bytes, data_tokens=lengths.total_tokens, reference=reference,
        value_model=value, reward_models=reward_models, engine=engine, generation=generation,
    )


def _reward_model_shape(entry: RewardModelSpec, policy: ModelShape) -> ModelShape:
    """A reward model folder's shape; a snapshot's is taken as the policy's (it is read at run start)."""
    return read_model_shape(entry.model) if entry.model is not None else policy


def check_memory(cfg: RunConfig, memory: MemoryEstimate, device: DeviceInfo, source: Path) -> list[str]:
    """Refuse a run whose estimated peak exceeds the device (exit 2); warn when it exceeds what is
    free right now. CPU: host RAM; CUDA: the smallest visible GPU, and host RAM for the rest."""
    kind = cfg.algorithm.kind
    if memory.device == "cuda":
        capacity = min(total for _, total in device.gpus)
        where = f"the GPU ({device.gpus[0][0]}, {format_bytes(capacity)})"
    else:
        capacity = device.host_total_bytes
        where = f"this machine's RAM ({format_bytes(capacity)})"
    biggest = max((k for k in memory.parts if k not in ("runtime",)), key=lambda k: memory.parts[k])
    if memory.total_bytes > capacity:
        raise located_error(
            source, ["algorithm", kind, "minibatch_size"],
            f"estimated peak memory {format_bytes(memory.total_bytes)} ({memory.peak_phase}; largest part"
            f" {biggest} {format_bytes(memory.parts[biggest])}) does not fit {where}: lower minibatch_size"
            " or packing.max_seq_len (and raise gradient_accumulation), use LoRA or bfloat16",
        )
    warnings = []
    if memory.device == "cuda" and memory.host_bytes > device.host_total_bytes:
        raise ConfigError(f"estimated host memory {format_bytes(memory.host_bytes)} does not fit this machine's"
                          f" RAM ({format_bytes(device.host_total_bytes)})")
    if memory.host_bytes > device.host_available_bytes:
        warnings.append(f"estimated peak host memory {format_bytes(memory.host_bytes)} is more than is free now"
                        f" ({format_bytes(device.host_available_bytes)})")
    return warnings


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
