"""bf16 linear layers whose weights are laid out once, at load, in oneDNN's own blocked format.

A plain ``torch.nn.Linear`` in bf16 on the CPU reaches oneDNN's matmul with its weight in PyTorch's row-major
layout, and the kernel rearranges that weight on every call: a 1.5B model's step then reads its weights at ~18
GB/s where one plain read of them reaches ~30 GB/s (docs/benchmarks.md, "CPU step"). Reordering each weight
once (``torch.ops.mkldnn._reorder_linear_weight``) and calling the matmul on the reordered copy
(``torch.ops.mkldnn._linear_pointwise``) is what ``torch.compile``'s CPU freezing pass does to a frozen graph;
we do the same to the eager model, so tree masks, the KV cache and every width keep working without a compile.

The products are the same oneDNN kernel on the same bf16 values: outputs equal ``F.linear``'s (bit-for-bit in
the tests at the widths a tree uses). On a CPU with AMX oneDNN runs the tiles (``brg_matmul:..._amx``); without
them its AVX-512 BF16 path; a CPU with neither AVX-512 nor AVX-NE-CONVERT has no packed bf16 path and keeps the
plain layers (:func:`bf16_path`). ``SPECGRAFT_PREPACK=0`` keeps the plain layers (for measuring the difference).
"""

from __future__ import annotations

import functools
import os

import torch

# What oneDNN is told of the row count when it picks a blocked layout: decode and tree verification run few rows
# (1..64). The layout serves every row count; the hint only chooses among equally valid blockings.
BATCH_HINT = 1


def available() -> bool:
    """Whether this PyTorch has the oneDNN ops (CPU builds with mkldnn), this CPU runs their bf16 path, and
    packing is not switched off."""
    if os.environ.get("SPECGRAFT_PREPACK", "1") == "0":
        return False
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")) and bf16_path()


@functools.cache
def bf16_path() -> bool:
    """oneDNN's packed bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU (an AMD EPYC
    Milan) the reorder raises, and the model keeps its plain layers. Asked of PyTorch on a tiny weight, which is
    what it decides by, rather than read from the CPU flags."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), BATCH_HINT)
    except RuntimeError:
        return False
    return True


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` on a bf16 weight held in oneDNN's blocked layout (an opaque ``mkldnn`` tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        dense = weight.detach().to(torch.bfloat16).contiguous()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(dense, BATCH_HINT), persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack(model: torch.nn.Module) -> list[str]:
    """Swap every bf16 ``nn.Linear`` of a CPU model for a :class:`PackedLinear` (in place); the names swapped.
    A head tied to the embedding gets its own packed copy: the embedding keeps its table for the gathers."""
    if not available():
        return []
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module.weight.dtype != torch.bfloat16 or module.weight.is_cuda:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, PackedLinear(module.weight, module.bias))
        swapped.append(name)
    if swapped and getattr(model.config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the packed head is a copy now: nothing may re-tie it
    return swapped
