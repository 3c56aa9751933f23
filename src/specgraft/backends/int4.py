"""The GGUF's own 4-bit weights on the transformers backend (``--dtype int4``).

A GGUF's 4-bit tensors are already what a weight-only int4 kernel with group size 32 computes with: every 32
weights of a row share one scale and one offset, and each weight is a 4-bit code ``q`` in 0..15:

    Q4_0   w = d * (q - 8)                          (d: fp16 per 32)
    Q4_1   w = d * q + m                            (d, m: fp16 per 32)
    Q4_K   w = (d * sc_j) * q - (dmin * m_j)        (d, dmin: fp16 per 256; sc_j, m_j: 6-bit per 32)

PyTorch's CPU kernel (``torch._weight_int4pack_mm_for_cpu``, in PyTorch itself, AVX-512 / AVX2) computes
``x @ W.T`` with ``W = (q - 8) * scale + zero`` per group of 32, so each GGUF block maps onto it exactly:
``scale = d`` (``d * sc_j``) and ``zero = offset + 8 * scale``. The codes are the file's; only ``scale`` and
``zero`` are rounded, to bf16, because the kernel takes them in the activations' dtype (bf16: its fp32 path is
a slow reference loop, ~70x slower, measured). Every other tensor (Q6_K, Q8_0, embeddings, norms, biases) keeps
the bf16 copy of its dequantised value. So an int4 model differs from the dequantised GGUF by about as much as
the bf16 model does (``convert(..., reference)`` measures it per layer); it is the user's weights, not a re-quantisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import SpecgraftError

GROUP = 32  # weights per scale/offset in every supported GGUF type, and the kernel's group size
INNER_K_TILES = 8  # the CPU packing's tile parameter (the value torchao's CPU int4 layout uses)

# GGUF tensor -> Hugging Face module, for the decoder layouts transformers reads from GGUF (llama, qwen2)
LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def _f16(col: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32).reshape(col.shape[0])


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` bytes -> ``[n, 32]`` codes: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _zero(scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The kernel's zero sits at code 8: ``(q - 8) * scale + zero = scale * q + offset``."""
    return offset + 8.0 * scale


def codes(type_name: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """A GGUF tensor's bytes ``[n, row_bytes]`` -> ``(q [n, k] uint8 in 0..15, scale [n, k/32], offset [n, k/32])``
    with ``w = scale * q + offset`` per group of 32 (fp32, exactly the file's values); None for types that are
    not a 4-bit group-32 code."""
    from gguf.quants import Q4_K  # its 6-bit scale/min unpacking, the library's own

    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if type_name in ("Q4_0", "Q4_1"):
        size = 18 if type_name == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        d = _f16(blocks[:, 0:2])
        if type_name == "Q4_0":
            offset, qs = -8.0 * d, blocks[:, 2:]
        else:
            offset, qs = _f16(blocks[:, 2:4]), blocks[:, 4:]
        return _nibbles_32(qs).reshape(n, k), d.reshape(n, -1), offset.reshape(n, -1)
    if type_name == "Q4_K":
        blocks = raw.reshape(-1, 144)  # d, dmin (fp16), 12 bytes of scales and mins, 128 bytes of codes
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = (a.astype(np.float32) for a in Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16])))
        qs = blocks[:, 16:].reshape(-1, 4, 32)  # four 32-byte chunks: low nibbles -> group 2i, high -> 2i+1
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
        return q.reshape(n, k), (d[:, None] * sc).reshape(n, -1), (-dmin[:, None] * mn).reshape(n, -1)
    return None


class Int4Linear(torch.nn.Module):
    """``y = x @ W.T (+ b)`` with ``W`` as 4-bit codes and a bf16 scale and zero per 32 inputs (see the module)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        zero = _zero(scale, offset)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES))
        # [k/32, n, 2]: the kernel's layout of (scale, zero)
        self.register_buffer("scale_zero", torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)

    @staticmethod
    def weight(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """The weight such a layer computes with, ``[n, k]`` fp32: the codes with bf16-rounded scale and zero."""
        s = scale.to(torch.bfloat16).float()
        z = _zero(scale, offset).to(torch.bfloat16).float()
        return ((q.float() - 8.0).reshape(*s.shape, GROUP) * s[..., None] + z[..., None]).reshape(q.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed, GROUP,
                                             self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


@dataclass
class Int4Report:
    """Which linear layers run on 4-bit codes, which stay bf16, and how far each int4 layer's weight is from the
    dequantised GGUF's (the fp32 safetensors copy): max |error| and max |weight| per layer."""

    int4: dict[str, tuple[float, float]] = field(default_factory=dict)
    bf16: dict[str, str] = field(default_factory=dict)  # module -> the GGUF type that kept it there


def _row_order(gguf_name: str, n: int, config) -> np.ndarray:
    """llama's GGUF stores q/k rows permuted for its rotary layout; transformers undoes it on load (the same
    reverse permutation, on row indices); other layouts keep the file's order."""
    if config.model_type != "llama" or not any(f".{p}." in gguf_name for p in ("attn_q", "attn_k")):
        return np.arange(n)
    heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if gguf_name == "output.weight":
        return "lm_head"
    if parts[0] == "blk" and parts[-1] == "weight" and parts[2] in LAYER_MODULES:
        return f"model.layers.{parts[1]}.{LAYER_MODULES[parts[2]]}"
    return None


def _untie_head(model) -> None:
    """A tied head computing from 4-bit codes would also change the embedding's table: give it its own."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is embed.weight:
        head.weight = torch.nn.Parameter(embed.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False


def convert(model, gguf: str | Path, reference: dict[str, torch.Tensor] | None = None) -> Int4Report:
    """Swap every linear layer whose GGUF tensor is a 4-bit group-32 code for an ``Int4Linear`` built from the
    file's codes (in place; ``model`` is the bf16 model of the same GGUF). A tied head stored once in the file
    (as ``token_embd``) follows the embedding's type. With ``reference`` (the dequantised GGUF's fp32 weights by
    parameter name) each int4 layer's max |error| against it is measured."""
    from gguf import GGUFReader

    report = Int4Report()
    modules = dict(model.named_modules())
    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors["output.weight"] = tensors["token_embd.weight"]
    for name, tensor in tensors.items():
        hf = _hf_name(name)
        if hf is None:
            continue
        if hf not in modules:
            raise SpecgraftError(f"the GGUF's tensor {name} has no module {hf} in the model: not the same layout")
        k, n = (int(x) for x in tensor.shape[:2])
        found = codes(tensor.tensor_type.name, tensor.data, n, k) if k % GROUP == 0 else None
        if found is None:
            report.bf16[hf] = tensor.tensor_type.name
            continue
        if hf == "lm_head":
            _untie_head(model)
        order = _row_order(name, n, model.config)
        q, scale, offset = (torch.from_numpy(np.ascontiguousarray(a[order])) for a in found)
        old = modules[hf]
        layer = Int4Linear(q, scale, offset, old.bias)
        parent, _, attr = hf.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
        report.int4[hf] = (float("nan"), float("nan"))
        if reference is not None:
            ref = reference[f"{hf}.weight"].float()
            err = (Int4Linear.weight(q, scale, offset) - ref).abs().max()
            report.int4[hf] = (float(err), float(ref.abs().max()))
    return report
