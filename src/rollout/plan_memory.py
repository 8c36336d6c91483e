"""Peak-memory estimate of a training run, from shapes only: no weights are loaded.

    shape = read_model_shape(Path("local/models/tiny"))        # config.json + safetensors headers
    workload = Workload(algorithm="sft", policy=shape, dtype="float32", ...)
    estimate = estimate_memory(workload, device="cpu")
    estimate.total_bytes, estimate.parts, estimate.peak_phase
    device = probe_device("auto")                               # CPU RAM, or each GPU's memory

`rollout plan` builds the `Workload` from the run config (`rollout.plan`); this module reads no
config object. The estimate is a sum of named parts, in bytes:

- `runtime`: the process before any model (python, torch, transformers, rollout, the store),
  measured per algorithm (`RUNTIME_BYTES`) with `benchmarks/plan_memory.py`.
- `data`: the rows and their token ids as Python objects (`DATA_BYTES_PER_FILE_BYTE`,
  `DATA_BYTES_PER_TOKEN`).
- `weights`: the policy's parameters (counted from the safetensors headers), in the configured
  dtype; `reference`, `value_model`, `reward_models` and `engine` (GRPO/PPO's generation copy) the
  same way for every other model the run holds.
- `optimizer`: AdamW's two moments (SGD with momentum: one) of every trainable parameter (all of
  them, or the LoRA adapters), in the parameter dtype, as torch keeps them.

and three transient phases, of which the largest counts (they never overlap):

- `activations` (a training micro-batch): per token and decoder layer about `10·hidden +
  4·intermediate` saved values (norm inputs/outputs, q/k/v after rotary and GQA repeat, the
  attention output, gate/up/act/product of the MLP), times `ACTIVATION_FACTOR` (calibrated;
  sdpa's kernels never materialise the T×T scores), plus `LOGITS_COPIES` fp32 copies of the
  vocabulary logits at the positions a loss reads (SFT and the prefix log-probs of DPO/GRPO run
  the LM head on target tokens only). Gradients are allocated while backward frees activations,
  so this phase is `max(activations, gradients)`.
- `snapshot`: a train_state snapshot serialises weights and optimizer state to safetensors bytes
  while the gradients of the last step are still held: `gradients + SNAPSHOT_FACTOR · (weights +
  optimizer)`.
- `generation` (GRPO/PPO): the engine's key/value cache, `rows × (prompt + completion) × layers ×
  2 × kv_heads × head_dim × dtype` (twice: admitting rows copies the cache), and the decode
  step's fp32 logits.

On CUDA the model parts sit on the GPU and are compared with the GPU's memory; the snapshot's
bytes and the runtime stay in host RAM. The constants were measured on the CPU (torch 2.13,
transformers 5.23, one thread) with `benchmarks/plan_memory.py`, which plans and runs short SFT,
DPO and GRPO configs and compares the estimate with the run's peak RSS (ru_maxrss):

    model  case      estimate  measured  error   peak phase
    tiny   sft         490Mi     480Mi   +2.2%   train_step    (1.05M parameters)
    tiny   sft-long    579Mi     553Mi   +4.7%   train_step    (4 rows x 512 tokens)
    tiny   dpo         480Mi     477Mi   +0.5%   train_step
    tiny   grpo        495Mi     492Mi   +0.7%   train_step
    52m    sft        2432Mi    2523Mi   -3.6%   snapshot      (52.2M parameters)
    52m    sft-long   2529Mi    2489Mi   +1.6%   train_step
    52m    dpo        2616Mi    2484Mi   +5.3%   snapshot
    52m    grpo       2631Mi    2547Mi   +3.3%   snapshot

(2026-11-23, a loaded 2-core VM; the measuring process stays small, since Linux carries a parent's
peak into its child's ru_maxrss.)
The GPU figures use the same physics but were not measured (no GPU on the bench machine).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout.errors import ModelError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MiB = 2**20

# ---- calibrated constants (benchmarks/plan_memory.py re-measures them)
RUNTIME_BYTES: dict[str, int] = {
    "sft": 440 * MiB, "rm": 440 * MiB, "dpo": 425 * MiB, "kto": 425 * MiB, "grpo": 440 * MiB, "ppo": 450 * MiB,
}
"""Peak RSS of a run on a model of ~no size, per algorithm: interpreter, torch, transformers,
tokenizers, rollout and the store (CPU, torch 2.13, transformers 5.23)."""
CUDA_CONTEXT_BYTES = 600 * MiB
"""Host memory the CUDA runtime maps once initialised (not measured here: no GPU on the bench)."""
GPU_RESERVED_BYTES = 1024 * MiB
"""Per GPU: the CUDA context, cuBLAS workspaces and the caching allocator's slack."""
ACTIVATION_FACTOR = 1.1
"""Measured saved activations over the `10·hidden + 4·intermediate` count (sdpa, CPU)."""
LOGITS_COPIES = 3
"""fp32 copies of the logits at loss positions: the logits, log-softmax and its gradient."""
SNAPSHOT_FACTOR = 2.0
"""Peak bytes a train_state snapshot holds per byte of weights + optimizer state (tensors gathered,
safetensors bytes, the blob being hashed and written)."""
DATA_BYTES_PER_FILE_BYTE = 8
"""Parsed JSON rows as Python dicts and strings, per byte of the dataset file."""
DATA_BYTES_PER_TOKEN = 48
"""A token id in a tuple (pointer + int object) and its loss-mask entry."""


# --------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model, read without loading its weights."""

    num_params: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int | None
    architecture: str

    def weight_bytes(self, dtype: str) -> int:
        return self.num_params * DTYPE_BYTES[dtype]

    def lora_params(self, r: int, target_modules: Sequence[str]) -> int:
        """Adapter parameters of LoRA rank `r` on the named linear layers of every decoder layer:
        r·(in + out) per adapted matrix (a name this count does not know is taken as hidden→hidden)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        per_layer = sum(r * sum(dims.get(name, (h, h))) for name in target_modules)
        return per_layer * self.num_layers

    def to_dict(self) -> dict[str, int | str | None]:
        return {
            "num_params": self.num_params, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings, "architecture": self.architecture,
        }


def read_model_shape(model_dir: Path) -> ModelShape:
    """The shape of the model in `model_dir`: its config.json for the layer sizes, and the exact
    parameter count from the safetensors headers (the first few KB of each file), or from the
    layer sizes when there are no safetensors files."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelError(f"{model_dir}: not a model folder (no config.json)") from None
    except (OSError, ValueError) as err:
        raise ModelError(f"{model_dir}/config.json: cannot read it: {err}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{model_dir}/config.json: not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        hidden = int(_first(text, "hidden_size", "n_embd", "d_model"))
        layers = int(_first(text, "num_hidden_layers", "n_layer", "num_layers"))
        heads = int(_first(text, "num_attention_heads", "n_head", "num_heads"))
        vocab = int(_first(text, "vocab_size"))
    except (KeyError, TypeError, ValueError) as err:
        raise ModelError(f"{model_dir}/config.json: no usable {err} for the memory estimate") from None
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    intermediate = int(text.get("intermediate_size") or text.get("n_inner") or 4 * hidden)
    positions = text.get("max_position_embeddings") or text.get("n_positions")
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    counted = _count_safetensors_params(model_dir)
    num_params = counted if counted is not None else _count_from_shape(
        hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, vocab=vocab, tied=bool(config.get("tie_word_embeddings", True)),
    )
    return ModelShape(
        num_params=num_params, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab,
        max_position_embeddings=int(positions) if positions else None, architecture=str(architectures[0]),
    )


def _first(config: Mapping[str, object], *keys: str) -> object:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise KeyError(keys[0])


def _count_safetensors_params(model_dir: Path) -> int | None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            count = 1
            for dim in info.get("shape", []):
                count *= int(dim)
            total += count
    return total


def _safetensors_header(path: Path) -> dict[str, object]:
    """The JSON header of a safetensors file: 8 bytes of little-endian length, then the header."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * MiB:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise ModelError(f"{path}: not a readable safetensors file ({err})") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: not a readable safetensors file (header is not an object)")
    return header


def _count_from_shape(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, vocab: int, tied: bool
) -> int:
    """Parameters of a Llama-style decoder (biases and norms are a rounding error here)."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    embeddings = vocab * hidden * (1 if tied else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class TrainPass:
    """One micro-batch through the trained model."""

    rows: int
    """Sequences in the micro-batch (a preference pair is two)."""
    tokens: int
    """Token positions the forward computes (rows × padded length, or less with shared prompts)."""
    logit_positions: int
    """Positions whose vocabulary logits a loss reads."""


@dataclass(frozen=True)
class Generation:
    """GRPO/PPO sampling: the engine's batch."""

    rows: int
    """Sequences decoded at once (prompts × generations, at most the engine's batch size)."""
    seq_len: int
    """Longest prompt + completion."""


@dataclass(frozen=True)
class Workload:
    """What a run holds and computes, as plain numbers (`rollout.plan` builds it from the config)."""

    algorithm: str
    policy: ModelShape
    dtype: Literal["float32", "bfloat16", "float16"]
    trainable_params: int
    """Parameters with gradients and optimizer state: all of the policy's, or its LoRA adapters."""
    optimizer_states: int
    """Tensors per trainable parameter: AdamW 2, SGD with momentum 1, plain SGD 0."""
    train: TrainPass
    data_file_bytes: int = 0
    data_tokens: int = 0
    reference: ModelShape | None = None
    """A frozen copy of a policy-shaped model (DPO/KTO/GRPO/PPO reference)."""
    value_model: ModelShape | None = None
    """PPO: a second model trained under the same optimizer."""
    reward_models: tuple[ModelShape, ...] = ()
    engine: ModelShape | None = None
    """GRPO/PPO: the generation engine's own copy of the weights."""
    generation: Generation | None = None


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per named part, the phase that peaks, and the totals."""

    device: Literal["cpu", "cuda"]
    parts: dict[str, int]
    peak_phase: str
    total_bytes: int
    """Peak on the device the model lives on: host RAM (cpu) or one GPU (cuda)."""
    host_bytes: int
    """Peak host RAM (equal to total_bytes on cpu)."""

    def to_dict(self) -> dict[str, object]:
        return {"device": self.device, "parts": dict(self.parts), "peak_phase": self.peak_phase,
                "total_bytes": self.total_bytes, "host_bytes": self.host_bytes}


def activation_bytes(shape: ModelShape, train: TrainPass, dtype: str) -> int:
    """Saved activations of one training forward, plus the logits at loss positions."""
    per_token_layer = 10 * shape.hidden_size + 4 * shape.intermediate_size
    saved = ACTIVATION_FACTOR * train.tokens * shape.num_layers * per_token_layer * DTYPE_BYTES[dtype]
    logits = LOGITS_COPIES * train.logit_positions * shape.vocab_size * 4
    return int(saved + logits)


def kv_cache_bytes(shape: ModelShape, generation: Generation, dtype: str) -> int:
    """Keys and values of every decoded row at full length, twice (admitting rows copies the cache)."""
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]
    return 2 * generation.rows * generation.seq_len * per_token


def estimate_memory(w: Workload, *, device: Literal["cpu", "cuda"]) -> MemoryEstimate:
    """Peak memory of the run: resident parts plus the largest transient phase (module docstring)."""
    bytes_per = DTYPE_BYTES[w.dtype]
    weights = w.policy.weight_bytes(w.dtype)
    trainable = w.trainable_params + (w.value_model.num_params if w.value_model else 0)
    gradients = trainable * bytes_per
    optimizer = trainable * bytes_per * w.optimizer_states
    parts = {
        "weights": weights,
        "reference": w.reference.weight_bytes(w.dtype) if w.reference else 0,
        "value_model": w.value_model.weight_bytes(w.dtype) if w.value_model else 0,
        "reward_models": sum(m.weight_bytes(w.dtype) for m in w.reward_models),
        "engine": w.engine.weight_bytes(w.dtype) if w.engine else 0,
        "optimizer": optimizer,
        "gradients": gradients,
        "activations": activation_bytes(w.policy, w.train, w.dtype),
        "kv_cache": kv_cache_bytes(w.engine or w.policy, w.generation, w.dtype) if w.generation else 0,
    }
    snapshot_weights = weights + parts["value_model"]  # a snapshot holds every trained model's state
    phases = {
        "train_step": max(parts["activations"], gradients),
        "snapshot": gradients + int(SNAPSHOT_FACTOR * (snapshot_weights + optimizer)),
        "generation": gradients + parts["kv_cache"] + (
            w.generation.rows * w.policy.vocab_size * 4 if w.generation else 0),
    }
    peak_phase = max(phases, key=lambda k: phases[k])
    resident_model = sum(parts[k] for k in ("weights", "reference", "value_model", "reward_models", "engine",
                                            "optimizer"))
    runtime = RUNTIME_BYTES.get(w.algorithm, max(RUNTIME_BYTES.values()))
    data = DATA_BYTES_PER_FILE_BYTE * w.data_file_bytes + DATA_BYTES_PER_TOKEN * w.data_tokens
    parts = {"runtime": runtime, "data": data, **parts, "snapshot": phases["snapshot"] - gradients}
    if device == "cpu":
        total = runtime + data + resident_model + phases[peak_phase]
        return MemoryEstimate("cpu", parts, peak_phase, total, total)
    # cuda: models, optimizer, activations and the cache on the GPU; snapshot bytes go to the host
    gpu_phases = {k: v for k, v in phases.items() if k != "snapshot"}
    gpu_peak = max(gpu_phases, key=lambda k: gpu_phases[k])
    gpu_total = GPU_RESERVED_BYTES + resident_model + gpu_phases[gpu_peak]
    host_total = runtime + CUDA_CONTEXT_BYTES + data + int(SNAPSHOT_FACTOR * (snapshot_weights + optimizer))
    parts["gpu_reserved"] = GPU_RESERVED_BYTES
    return MemoryEstimate("cuda", parts, gpu_peak, gpu_total, host_total)


# --------------------------------------------------------------------------- the device


@dataclass(frozen=True)
class DeviceInfo:
    """Where the run trains and how much memory it has."""

    kind: Literal["cpu", "cuda"]
    name: str
    host_total_bytes: int
    host_available_bytes: int
    gpus: tuple[tuple[str, int], ...] = field(default=())
    """(name, total bytes) of each visible GPU."""

    def identity(self) -> dict[str, object]:
        """What must not change between plan and run (memory in use may)."""
        return {"kind": self.kind, "name": self.name, "gpus": [name for name, _ in self.gpus]}

    def to_dict(self) -> dict[str, object]:
        return {**self.identity(), "gpu_total_bytes": [b for _, b in self.gpus],
                "host_total_bytes": self.host_total_bytes, "host_available_bytes": self.host_available_bytes}


def probe_device(requested: Literal["auto", "cpu", "cuda"]) -> DeviceInfo:
    """The device `backend.device` resolves to (as the run would resolve it) and its memory.
    torch is imported only when CUDA may be asked for."""
    total, available = host_memory()
    gpus: tuple[tuple[str, int], ...] = ()
    if requested != "cpu":
        try:
            import torch
        except ImportError:
            torch = None  # type: ignore[assignment]
        if torch is not None and torch.cuda.is_available():
            gpus = tuple(
                (torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
                for i in range(torch.cuda.device_count())
            )
        elif requested == "cuda":
            raise ModelError("backend.device is \"cuda\" but no CUDA device is available")
    if gpus:
        return DeviceInfo("cuda", gpus[0][0], total, available, gpus)
    return DeviceInfo("cpu", _cpu_name(), total, available)


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host RAM: /proc/meminfo where there is one, else sysconf."""
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return pages, pages


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.partition(':')[2].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"cpu x{os.cpu_count()}"


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if unit != "KiB" else f"{n / size:.0f} {unit}"
    return f"{n} B"
