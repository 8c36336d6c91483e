"""The `vllm` engine: vLLM's offline `LLM` as an `InferenceEngine` (optional extra, GPU machines).

    pip install 'rollout[vllm]'         # on a CUDA machine
    [inference]
    engine = "vllm"

Only imported when chosen; without vLLM installed, building it raises a clear
`EngineUnavailable`. Log-probs are asked for in vLLM's "raw_logprobs" mode
(unfiltered, temperature-1), the same quantity as the hf engine returns.
Weight updates load tensors into the running model workers
(`collective_rpc`), without rebuilding the engine.

Not exercised by the CPU test suite (there is no vLLM here); it follows
vLLM's public `LLM` API (>= 0.10).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

from rollout.inference.hf_engine import _read_safetensors
from rollout.inference.types import (
    Completion,
    EngineUnavailable,
    FinishReason,
    GenerationError,
    Prompt,
    PromptLike,
    SamplingParams,
    StateDict,
    as_request,
)


def load_vllm_engine(
    model_path: str | Path,
    *,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.9,
    trust_remote_code: bool = False,
    model_name: str | None = None,
    seed: int = 0,
) -> VLLMEngine:
    try:
        import vllm
    except ImportError:
        raise EngineUnavailable(
            'engine "vllm" needs vLLM, which is not installed here',
            details=['install it on a CUDA machine (pip install vllm), or use engine = "hf"'],
        ) from None
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "dtype": dtype,
        "gpu_memory_utilization": gpu_memory_utilization,
        "trust_remote_code": trust_remote_code,
        "seed": seed,
        "logprobs_mode": "raw_logprobs",
    }
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    try:
        llm = vllm.LLM(**kwargs)
    except TypeError:  # an older vLLM without logprobs_mode
        kwargs.pop("logprobs_mode")
        llm = vllm.LLM(**kwargs)
    return VLLMEngine(llm, model_name=model_name or Path(str(model_path)).name)


class VLLMEngine:
    def __init__(self, llm: Any, *, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.get_tokenizer()
        self.max_model_len = int(llm.llm_engine.model_config.max_model_len)
        self._version = 0

    @property
    def weights_version(self) -> int:
        return self._version

    def tokenize(self, prompt: Prompt, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[int, ...]:
        if isinstance(prompt, str):
            return tuple(self.tokenizer(prompt)["input_ids"])
        ids = self.tokenizer.apply_chat_template(
            [dict(m) for m in prompt], add_generation_prompt=True, tokenize=True,
            tools=[dict(t) for t in tools] if tools else None,
        )
        return tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def generate(
        self, requests: Sequence[PromptLike], params: SamplingParams | None = None
    ) -> list[tuple[Completion, ...]]:
        import vllm

        default = params or SamplingParams()
        reqs = [as_request(r) for r in requests]
        prompts, sampling = [], []
        for r in reqs:
            p = r.params or default
            if p.tempered_logprobs and p.temperature not in (0.0, 1.0):
                raise GenerationError(
                    "vllm engine: tempered_logprobs at temperature != 1 is not available in-process (it"
                    " returns raw_logprobs); sample at temperature 1, or use the hf engine or a served one"
                )
            ids = r.prompt_token_ids if r.prompt_token_ids is not None else self.tokenize(r.prompt, r.tools)  # type: ignore[arg-type]
            prompts.append({"prompt_token_ids": list(ids)})
            sampling.append(
                vllm.SamplingParams(
                    n=p.n,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k if p.top_k > 0 else -1,
                    max_tokens=p.max_tokens,
                    stop=list(p.stop) or None,
                    stop_token_ids=list(p.stop_token_ids) or None,
                    seed=p.seed,
                    logprobs=p.top_logprobs,
                    ignore_eos=p.ignore_eos,
                )
            )
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        results = []
        for r, out in zip(reqs, outputs, strict=True):
            prompt_ids = tuple(out.prompt_token_ids)
            completions = []
            for c in out.outputs:
                ids = tuple(c.token_ids)
                lps = tuple(float(step[t].logprob) for t, step in zip(ids, c.logprobs or [], strict=False))
                top = None
                if (r.params or default).top_logprobs and c.logprobs:
                    top = tuple(tuple((t, float(v.logprob)) for t, v in step.items()) for step in c.logprobs)
                reason: FinishReason = "length" if c.finish_reason == "length" else "stop"
                completions.append(
                    Completion(
                        c.index,
                        c.text,
                        ids,
                        lps,
                        reason,
                        len(prompt_ids),
                        len(ids),
                        prompt_ids,
                        top,
                        self._version,
                    )
                )
            done = tuple(completions)
            if r.on_finish is not None:
                r.on_finish(done)
            results.append(done)
        return results

    def update_weights(self, weights: StateDict | str | PathLike[str]) -> int:
        """Load tensors into every worker's model in place (vLLM's `load_weights`)."""
        if isinstance(weights, str | PathLike):
            weights = _read_safetensors(Path(weights))
        items = [(name, tensor) for name, tensor in weights.items()]

        def _load(worker: Any) -> None:  # runs inside each vLLM worker
            worker.model_runner.model.load_weights(weights=items)

        try:
            self.llm.collective_rpc(_load)
        except Exception as err:  # vLLM's internal API moves between versions
            raise GenerationError(f"vllm: cannot load new weights: {err}") from None
        self._version += 1
        return self._version

    def close(self) -> None:
        del self.llm
