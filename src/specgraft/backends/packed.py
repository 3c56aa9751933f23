"""Linear layers whose weights are laid out once, at load, in oneDNN's own blocked format (bf16 and fp32).

A plain ``torch.nn.Linear`` on the CPU reaches its matmul with the weight in PyTorch's row-major layout, and the
kernel rearranges that weight on every call. In bf16 a 1.5B model's step then reads its weights at ~18 GB/s where
one plain read of them reaches ~30 GB/s (docs/benchmarks.md, "CPU step"). In fp32 on an AVX2-only CPU (an AMD
EPYC Milan) the plain product of more than one row costs 2-3x the packed one (a 1536 x 8960 layer at 4 rows:
8.2 ms plain, 3.6 ms packed; the same benchmarks page): tree verification and batched drafting, which run 2-64
rows, pay it on every layer. Reordering each weight once (``torch.ops.mkldnn._reorder_linear_weight``) and
calling the matmul on the reordered copy (``torch.ops.mkldnn._linear_pointwise``) is what ``torch.compile``'s CPU
freezing pass does to a frozen graph; we do the same to the eager model, so tree masks, the KV cache and every
width keep working without a compile.

bf16: the products are the same oneDNN kernel on the same bf16 values (bit-for-bit where the plain layer runs
oneDNN too). fp32: another summation order than the plain kernel's (differences of one or two fp32 roundings, as
between two row counts of the plain kernel), so a packed fp32 model is exact against *itself*: AR and every
speculative method run the same packed layers, and the losslessness tests compare them. On a CPU with AMX oneDNN
runs bf16 tiles (``brg_matmul:..._amx``); without them its AVX-512 BF16 path; a CPU with neither AVX-512 nor
AVX-NE-CONVERT has no packed bf16 path and keeps plain bf16 layers (:func:`bf16_path`); fp32 is packed on every
x86 CPU oneDNN supports. ``SPECGRAFT_PREPACK=0`` keeps the plain layers (for measuring the difference).
"""

from __future__ import annotations

import os

import torch

from ..env import bf16_path, packed_path  # noqa: F401 -- re-exported: what this CPU packs

# What oneDNN is told of the row count when it picks a blocked layout: decode and tree verification run few rows
# (1..64). The layout serves every row count; the hint chooses among equally valid blockings, and the choice
# costs: on an AVX2-only EPYC a Qwen2.5-Coder-1.5B fp32 verify of 2-64 tokens laid out for 16 rows cost 0.61-0.88x
# the one laid out for 1, and the same at one token (docs/benchmarks.md, "The packed layout's row-count hint").
# bf16 keeps 1, what it was measured flat with (AVX-512 BF16, AMX).
BATCH_HINT = 1
HINTS = {torch.float32: 16, torch.bfloat16: BATCH_HINT}
DTYPES = (torch.bfloat16, torch.float32)


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this PyTorch has the oneDNN ops (CPU builds with mkldnn), this CPU runs their ``dtype`` path, and
    packing is not switched off."""
    if os.environ.get("SPECGRAFT_PREPACK", "1") == "0" or dtype not in DTYPES:
        return False
    # packed_path asks oneDNN itself (and is False without it); the matmul op must exist too
    return hasattr(torch.ops.mkldnn, "_linear_pointwise") and packed_path(dtype)


class PackedLinear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` on a bf16 or fp32 weight held in oneDNN's blocked layout (an opaque ``mkldnn``
    tensor); inputs are cast to the weight's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16,
                 hint: int | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = dtype
        self.hint = HINTS[dtype] if hint is None else hint  # the row count the layout is chosen for
        dense = weight.detach().to(dtype).contiguous()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(dense, self.hint), persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack(model: torch.nn.Module, hint: int | None = None) -> list[str]:
    """Swap every bf16 or fp32 ``nn.Linear`` of a CPU model whose dtype oneDNN packs here for a
    :class:`PackedLinear` (in place); the names swapped. A head tied to the embedding gets its own packed copy:
    the embedding keeps its table for the gathers. ``hint``: the row count the layout is chosen for (default: the
    dtype's in ``HINTS``; ``scripts/backend_costs.py hint-ab`` compares them)."""
    swapped = []
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module.weight.is_cuda or not available(module.weight.dtype):
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr,
                PackedLinear(module.weight, module.bias, module.weight.dtype, hint))
        swapped.append(name)
    config = getattr(model, "config", None)
    if swapped and getattr(config, "tie_word_embeddings", False):
        model.config.tie_word_embeddings = False  # the packed head is a copy now: nothing may re-tie it
    return swapped
