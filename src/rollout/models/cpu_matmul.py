"""Which library multiplies the float32 products of training passes on the CPU.

    set_cpu_matmul("onednn")           # once per run, from `[backend] cpu_matmul` (`run.prepare_process`)
    y = linear(x, layer.weight, layer.bias)   # the lean decoder's projections
    logits = project(lm_head, hidden)         # the LM head on the gathered positions

`"torch"` (the default) is `F.linear`: in torch's x86 CPU builds, MKL's sgemm. `"onednn"` sends the
same products -- forward, and both products of the backward (the input's and the weight's
gradients) -- to oneDNN (`torch.ops.mkldnn._linear_pointwise`), which torch's build also carries
and which the hf engine's prepacked decode products already use. The math is the same float32
product; the two libraries sum in different orders, so the bits differ in the last places (as on
another CPU), and each is deterministic for a given shape and thread count (resume stays
bit-identical, tested). Which is faster depends on the CPU: on an AMD EPYC VM with AVX-512, MKL's
products ran at about half oneDNN's speed at every training shape, a training step of the tiny
model was 1.44x faster at one thread (1.14x at two) and of a 48M model 1.63x; on an AMD EPYC VM
without AVX-512 it was slower: 0.82x / 0.79x (tiny, one / two threads), 0.88x (48M)
(`benchmarks/cpu_linear.py`, which says which to keep for the CPU it runs on). Hence opt-in.

Only the lean forward (`lean_decoder.lean_hidden_states`: llama, mistral, qwen2, qwen3 with plain
`nn.Linear` projections) and the LM head applied to gathered positions use it; models that run
through `model(...)` (LoRA, other architectures) keep torch's `F.linear`. CPU float32 only:
anything else (CUDA, bfloat16) and products of fewer than `MIN_ROWS` rows (the engine's decode
steps) are `F.linear` whatever the setting.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

KINDS = ("torch", "onednn")
_kind = "torch"
MIN_ROWS = 128
"""Fewest activation rows a product goes to oneDNN with. It lays the weight out for each call, which
costs more than it saves at a few rows: AMD EPYC VM, one thread, tiny-model shapes, `F.linear` /
oneDNN 0.3-0.5x at 1 row, 0.95-1.4x at 16, 1.3-1.7x at 32, ~2x from 128 in isolation; in GRPO's
training pass of 2 x 8 short completions (~90 rows) oneDNN made the step slower (0.028 against 0.026
s at 32), at 128 the same, while the demo's 16 x 8 batch went 0.101 -> 0.088 s/step."""


def available() -> bool:
    """Whether this torch build has oneDNN's linear."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def set_cpu_matmul(kind: str) -> None:
    """Use `kind`'s products from now on in this process (a run sets it at its start)."""
    global _kind
    if kind not in KINDS:
        raise ValueError(f"cpu_matmul must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "onednn" and not available():
        from rollout.errors import ConfigError

        raise ConfigError('backend.cpu_matmul = "onednn": this torch build has no oneDNN linear '
                          '(torch.ops.mkldnn._linear_pointwise); use "torch"')
    _kind = kind


def cpu_matmul() -> str:
    return _kind


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, in oneDNN where the setting and the tensors allow."""
    if _kind == "onednn" and _fits(x, weight):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def project(head: Any, x: torch.Tensor) -> torch.Tensor:
    """`head(x)`: a plain `nn.Linear` head through `linear`; anything else, and a head with hooks (FSDP's
    unsharding, offloading), called as it is."""
    if (_kind == "onednn" and type(head) is torch.nn.Linear and not head._forward_hooks
            and not head._forward_pre_hooks and not _global_hooks()):
        return linear(x, head.weight, head.bias)
    return head(x)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    plain = type(weight) in (torch.Tensor, torch.nn.Parameter) and type(x) is torch.Tensor  # not a DTensor
    return (plain and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() >= 2 and x.numel() >= MIN_ROWS * x.shape[-1] > 0 and weight.layout == torch.strided)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [.., k] x b[n, k].t() (+ bias) -> [.., n] in oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # grad [.., out] x weight [out, in]
            grad_x = _product(grad, weight.t())
        if ctx.needs_input_grad[1]:  # grad.t() [out, rows] x x [rows, in]
            grad_w = _product(rows.t(), x.reshape(-1, x.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b
