"""How the target attends over its cache when several query tokens share key/value heads (grouped-query attention).

transformers' SDPA path repeats every key/value head ``groups`` times (``repeat_kv``) whenever a forward has more
than one query token and a mask, which is every tree verification: a copy of the whole cache, ``groups`` times
over, in every layer, every step. Qwen2.5-Coder-1.5B has 12 query heads on 2 key/value heads, so a step over 16
rows of 400 cached tokens copied 6x its cache per layer and spent most of its attention time doing so.

:func:`grouped_sdpa` folds the ``groups`` query heads that share a key/value head into that head's query rows
instead, which needs only the (small) mask repeated::

    query  [B, kv * g, q, d]  ->  [B, kv, g * q, d]       row r * q + i = query i of head kv * g + r
    mask   [B, 1, q, S]       ->  [B, 1, g * q, S]        each query's row, once per head of the group
    key    [B, kv, S, d]          unchanged (no copy)

It is the same attention (each query row is scored against the same keys with the same mask); only the float
summation inside the kernel may differ, as between any two kernels. transformers already does this for one query
token (``pack_gqa``); everything this module does not handle (no mask, one query, per-head masks, dropout,
position biases) goes to transformers' own function unchanged.

:class:`PositionalLayer` is the cache those keys come from, written by position: each layer's keys and values
are a view ``[:, :, :n]`` of a buffer with spare columns, so a step writes its new columns in place instead of
concatenating (``DynamicLayer`` copies the whole cache every step).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "specgraft_sdpa"


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, q, d]``, ``key / value [B, kv, S, d]``, mask
    ``[B or 1, 1, q, S]``; returns ``[B, q, H, d]``."""
    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, dim = query.shape
    if (groups == 1 or q_len == 1 or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or attention_mask.shape[2] != q_len or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = heads // groups
    folded = query.reshape(b, kv_heads, groups * q_len, dim)
    mask = attention_mask.repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(out.shape[0], heads, q_len, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks transformers builds for SDPA (a prefill's causal one)


def use_grouped_attention(model: torch.nn.Module) -> bool:
    """Switch a model on transformers' SDPA with grouped key/value heads to :func:`grouped_sdpa`; True if it now
    runs it. Models on another attention implementation (eager, flash) or without grouped heads are left alone."""
    config = model.config
    grouped = any(getattr(m, "num_key_value_groups", 1) > 1 for m in model.modules())
    if getattr(config, "_attn_implementation", None) == "sdpa" and grouped:
        model.set_attn_implementation(NAME)
    return getattr(config, "_attn_implementation", None) == NAME


@contextmanager
def stock_attention(model: torch.nn.Module):
    """transformers' own SDPA for the duration (an outside reference, e.g. its assisted generation, must run
    stock transformers), switched back afterwards."""
    ours = getattr(getattr(model, "config", None), "_attn_implementation", None) == NAME
    if ours:
        model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        if ours:
            model.set_attn_implementation(NAME)


SPARE = 128  # spare columns a buffer is given when it grows: one copy per 128+ columns appended, not per step


class PositionalLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` ``[B, kv, n, d]`` are prefix views of buffers
    ``[B, kv, capacity, d]``; :meth:`update` writes the new columns at ``n``. Code may still assign ``keys`` /
    ``values`` (rows joining or leaving, trimming to a shorter prefix): a slice ``[:, :, :m]`` of the current
    view stays in the buffer; any other tensor is copied into a new buffer at the next update."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buf = self._value_buf = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._key_buf = _write(self.keys, self._key_buf, key_states)
        self.values, self._value_buf = _write(self.values, self._value_buf, value_states)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        super().reset()


def _write(view: torch.Tensor, buf: torch.Tensor | None, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``new [B, kv, m, d]`` after ``view``'s ``n`` columns; returns the longer view and its buffer."""
    n = view.shape[2] if view.dim() == 4 else 0
    m = new.shape[2]
    if not (_prefix_of(view, buf) and buf.shape[:2] == new.shape[:2] and n + m <= buf.shape[2]):
        grown = new.new_empty(new.shape[0], new.shape[1], (n + m) // SPARE * SPARE + 2 * SPARE, new.shape[3])
        if n:
            grown[:, :, :n] = view
        buf = grown
    buf[:, :, n: n + m] = new
    return buf[:, :, : n + m], buf


def _prefix_of(view: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """Whether ``view`` is ``buf[:, :, :n]`` (it shares the first element and the strides)."""
    return (buf is not None and view.dim() == 4 and view.data_ptr() == buf.data_ptr()
            and view.stride() == buf.stride() and view.shape[3] == buf.shape[3] and view.shape[:2] == buf.shape[:2])


def positional_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PositionalLayer` s."""
    cache = DynamicCache(config=config)
    cache.layers = [PositionalLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
