"""Target backend: an unmodified ``AutoModelForCausalLM`` that verifies whole trees in one forward.

It owns the KV cache. The cache always holds exactly the committed prefix (``prefix_len`` tokens); the
root of the next tree (the last committed token) is *not* cached yet, so each step's forward writes the
root and every candidate, and :meth:`commit` keeps only the root and the accepted path::

    cache before verify:  [ p0 p1 ... p(P-1) ]
    verify writes:        [ p0 ... p(P-1) | r  n1 n2 n3 n4 ... ]      (W tree slots)
    commit([0, 1, 3]):    [ p0 ... p(P-1) | r  n1 n3 ]                (P += 3)

Batch size is 1 here; the mask and position builders already carry a batch dimension so that a later
batch mode can stack requests.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..errors import SpecgraftError
from .tree import Tree


@dataclass
class VerifyOutput:
    logits: torch.Tensor  # [W, V] in the model dtype (rules upcast where they need to)
    hidden: dict[int, torch.Tensor] | None  # layer index -> [W, H], when asked


def check_tree_support(config) -> None:
    """Refuse models whose attention we cannot steer with one additive mask (sliding-window layers)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any("sliding" in str(t) for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise SpecgraftError(
            f"model type '{config.model_type}' uses sliding-window attention layers, which tree verification "
            "does not support yet (needs a per-layer-type mask)"
        )


class TargetBackend:
    def __init__(self, model: torch.nn.Module):
        check_tree_support(model.config)
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.cache: DynamicCache | None = None
        self.prefix_len = 0
        # transformers 5.x renamed `past_key_values` to `cache`; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.prefix_len = 0

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, all_logits: bool = False, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Cache ``ids: [T]``; logits ``[T, V]`` (or ``[1, V]``: the last position), hidden states ``[T, H]``."""
        self.reset()
        out = self.model(
            input_ids=ids.unsqueeze(0),
            use_cache=True,
            **{self._cache_kw: self.cache},
            logits_to_keep=0 if all_logits else 1,
            output_hidden_states=bool(hidden_layers),
        )
        self.prefix_len = int(ids.shape[0])
        hidden = {i: out.hidden_states[i][0] for i in hidden_layers} if hidden_layers else None
        return VerifyOutput(out.logits[0], hidden)

    @torch.inference_mode()
    def verify(self, tree: Tree, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """One forward over all ``W`` tree nodes; logits at every node (and chosen hidden states)."""
        p = self.prefix_len
        out = self.model(
            input_ids=tree.tokens.unsqueeze(0),
            position_ids=tree.position_ids(p),
            attention_mask=tree.attention_mask(p, self.dtype),
            use_cache=True,
            **{self._cache_kw: self.cache},
            output_hidden_states=bool(hidden_layers),
        )
        hidden = None
        if hidden_layers:
            hidden = {i: out.hidden_states[i][0] for i in hidden_layers}
        return VerifyOutput(out.logits[0], hidden)

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Append ``n`` speculative nodes after the committed prefix and earlier speculative ones.

        ``visible: bool[n, A + n]`` says which of the ``A`` already appended speculative positions and of
        the ``n`` new ones each new node attends to (the prefix is always visible). Used by drafters that
        grow a tree level by level in their own cache; :meth:`truncate` drops the speculation afterwards.
        """
        p, n = self.prefix_len, tokens.shape[0]
        mask = torch.zeros(1, 1, n, self.cache.get_seq_length() + n, dtype=self.dtype)
        mask[0, 0, :, p:].masked_fill_(~visible, torch.finfo(self.dtype).min)
        out = self.model(input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0), attention_mask=mask,
                         use_cache=True, **{self._cache_kw: self.cache})
        return out.logits[0]

    def truncate(self, length: int) -> None:
        """Drop cached positions from ``length`` on (a drafter rolling back its own speculation)."""
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
        self.prefix_len = min(self.prefix_len, length)

    @torch.inference_mode()
    def commit(self, accepted: list[int]) -> None:
        """Keep the root and the accepted path (node indices, root first); drop the other tree slots."""
        p, m = self.prefix_len, len(accepted)
        contiguous = accepted == list(range(m))  # a chain prefix: the rows are already in place
        idx = None if contiguous else torch.tensor(accepted, dtype=torch.long) + p
        for layer in self.cache.layers:
            if idx is not None:
                layer.keys[:, :, p : p + m] = layer.keys.index_select(2, idx)
                layer.values[:, :, p : p + m] = layer.values.index_select(2, idx)
            layer.keys = layer.keys[:, :, : p + m]
            layer.values = layer.values[:, :, : p + m]
        self.prefix_len = p + m
