"""Target backend: an unmodified ``AutoModelForCausalLM`` that verifies B requests' trees in one forward.

It owns one KV cache for all active requests (rows), each layer a buffer written by position
(``core/attention.py``, which also attends without copying grouped key/value heads). Row ``i`` holds exactly its
committed prefix in columns ``[0, len_i)``; the root of its next tree (its last committed token) is *not* cached
yet. The cache is right-padded: columns ``len_i .. L-1`` of a shorter row are holes that the additive mask
hides, and positions are explicit, so holes never shift RoPE. A step appends ``W`` tree columns for every row at
``L``; :meth:`commit_batch` copies each row's accepted columns down to ``len_i`` and trims the cache to the
longest row, so it never grows beyond ``max len + W`` (docs/design.md §2)::

    B = 1   before verify:  [ p0 ... p(P-1) ]
            verify writes:  [ p0 ... p(P-1) | r  n1 n2 n3 n4 ]     (W tree slots)
            commit [0,1,3]: [ p0 ... p(P-1) | r  n1 n3 ]           (P += 3)

    B = 2   row 0: [ a a a a a . . | r n n n ]    len 5, accepts [0, 2]  ->  [ a a a a a r n2 ]
            row 1: [ b b b b b b b | r n n . ]    len 7, accepts [0]     ->  [ b b b b b b b r ]
                   (. = hole; the cache is then trimmed to max(7, 8) = 8 columns)

A request joins with :meth:`add` (prefilled alone, its row appended) and leaves with :meth:`remove`.
With one row, :meth:`verify` / :meth:`commit` / :meth:`extend` / :meth:`truncate` are the single-sequence
API that drafters with their own model (the draft model) use.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from transformers import DynamicCache

from ..errors import SpecgraftError
from .attention import positional_cache, use_grouped_attention
from .tree import Tree


@dataclass
class VerifyOutput:
    logits: torch.Tensor  # [W, V] in the model dtype (rules upcast where they need to)
    hidden: dict[int, torch.Tensor] | None  # layer index -> [W, H], when asked


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, declared once: the engine, the registry, ``auto`` and the server read this, never
    the backend's type (docs/design.md, "The Backend protocol")."""

    name: str  # "transformers", "llamacpp": in every record and message
    weights: str  # the weights' format, in every record and cost-curve key: "float32", "bfloat16", "int4", "gguf"
    runtime: str  # what else a cost curve measured on it depends on: threads, library version
    device: str = "cpu"  # where its forwards run
    hidden_states: bool = False  # returns the hidden state entering chosen layers (EAGLE-3 heads, Graft on them)
    references: tuple[str, ...] = ()  # outside references whose library loop runs on ``Backend.model``
    label: str = ""  # how messages name it ("llama.cpp"); ``name`` when empty
    # ``feed_rows`` / ``extend_rows`` / ``truncate_row``: append chains, or tree levels, to chosen rows in one
    # forward, so a draft model's context serves every request in flight (drafts batched; drafters/draft_model.py)
    row_feeds: bool = False
    # Below this logit gap a tree forward and a one-token forward may pick different tokens (a near-tie): a few
    # bf16 ULPs at typical logit sizes (the measured divergences: <= 0.25); fp32: the tests' tie gap; llama.cpp:
    # activations re-quantised at every matmul turn summation order into differences up to ~1 (docs/backends.md)
    tie_gap: float = 0.5
    tie_note: str = ""  # why such a tie may differ here, and what to do about it (--compare's note)

    @property
    def shown(self) -> str:
        return self.label or self.name


class Backend(Protocol):
    """What the engine and the drafters with their own model need from a backend (transformers: this module;
    llama.cpp: ``specgraft.backends.llamacpp``). Rows are requests; each holds exactly its committed prefix."""

    capabilities: Capabilities
    model: object  # the library's own handle on the weights (an HF module, a LlamaModel): heads and references
    lengths: list[int]
    max_positions: int
    vocab_size: int
    eos_ids: set[int]  # the model's end-of-sequence tokens (the tokenizer's are added by the engine)

    @property
    def name(self) -> str:
        """``capabilities.name``."""
        ...

    @property
    def rows(self) -> int: ...

    @property
    def prefix_len(self) -> int: ...

    def clone(self) -> "Backend":
        """An empty backend on the same weights."""
        ...

    def reset(self) -> None: ...

    def add(self, ids: torch.Tensor, all_logits: bool | torch.Tensor = False,
            hidden_layers: tuple[int, ...] = ()) -> "VerifyOutput": ...

    def prefill(self, ids: torch.Tensor, all_logits: bool = False,
                hidden_layers: tuple[int, ...] = ()) -> "VerifyOutput": ...

    def remove(self, row: int) -> None: ...

    def verify_batch(self, trees: list[Tree], hidden_layers: tuple[int, ...] = ()) -> list["VerifyOutput"]: ...

    def commit_batch(self, accepted: list[list[int]]) -> None: ...

    def verify(self, tree: Tree, hidden_layers: tuple[int, ...] = ()) -> "VerifyOutput": ...

    def commit(self, accepted: list[int]) -> None: ...

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor: ...

    def truncate(self, length: int) -> None: ...

    def capacity(self) -> dict[str, int]:
        """What is shared by every row and runs out (resource -> total): admission reserves against it."""
        ...

    def reservation(self, prompt_len: int, max_new: int, budget: int) -> dict[str, int]:
        """The most of each ``capacity`` resource one request can hold at once (prompt, output, widest tree)."""
        ...

    def draft_backend(self, model: str) -> "Backend":
        """A backend for a draft model (a registry name or a local path) on the same runtime and device."""
        ...


def check_tree_support(config) -> None:
    """Refuse models whose attention we cannot steer with one additive mask (sliding-window layers)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any("sliding" in str(t) for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise SpecgraftError(
            f"model type '{config.model_type}' uses sliding-window attention layers, which tree verification "
            "does not support yet (needs a per-layer-type mask)"
        )


def cache_keyword(model: torch.nn.Module) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache`` in some models; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class RowLengths:
    """Row bookkeeping both backends share: ``lengths[i]`` = row ``i``'s committed tokens."""

    lengths: list[int]
    capabilities: Capabilities

    @property
    def name(self) -> str:
        return self.capabilities.name

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def capacity(self) -> dict[str, int]:
        """Nothing shared runs out (a transformers cache grows with the longest row; rows are the server's
        ``--max-num-seqs``)."""
        return {}

    def reservation(self, prompt_len: int, max_new: int, budget: int) -> dict[str, int]:
        return {}

    @property
    def prefix_len(self) -> int:
        """The committed length of the only row (single-sequence API)."""
        if self.rows != 1:
            raise ValueError(f"prefix_len needs exactly one row, the cache has {self.rows}")
        return self.lengths[0]


def torch_runtime() -> str:
    """What a transformers cost curve depends on besides the model and the machine."""
    return f"threads={torch.get_num_threads()}|torch={torch.__version__}"


def _packed(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if any(getattr(b, "is_mkldnn", False) for b in m.buffers(recurse=False))]


def packed_layers(model: torch.nn.Module) -> int:
    """How many of the model's linear layers hold prepacked oneDNN weights (``backends/packed.py``)."""
    return len(_packed(model))


def packed_runtime(model: torch.nn.Module) -> str:
    """The cost-curve key's suffix for the model's layers: "" when none is packed, else ``|prepacked`` and the row
    count the layout was chosen for ("" for 1, the first layout, so its cached curves stay valid). Packed layers,
    and each layout, have their own curve."""
    layers = _packed(model)
    if not layers:
        return ""
    hint = max(getattr(m, "hint", 1) for m in layers)
    return "|prepacked" + ("" if hint == 1 else str(hint))


def head_rows(model: torch.nn.Module) -> int:
    """The output head's rows (the vocabulary it scores); any linear kind (plain, int4 codes, prepacked)."""
    head = model.get_output_embeddings()
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


DraftLoader = Callable[[str], "Backend"]


class TargetBackend(RowLengths):
    """The transformers backend. ``draft_loader(name)`` builds a draft model's backend (the caller knows where
    models come from: ``specgraft.backends.transformers_backend``); without one, draft models must be passed
    loaded."""

    def __init__(self, model: torch.nn.Module, draft_loader: DraftLoader | None = None, weights: str | None = None):
        """``weights`` names a format the parameters' dtype does not show (``int4``: 4-bit codes in buffers)."""
        check_tree_support(model.config)
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.draft_loader = draft_loader
        self.neg = torch.finfo(self.dtype).min
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self._cache_kw = cache_keyword(model)
        self.vocab_size = head_rows(model)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos_ids = {int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None}
        # The model (and its cache) may sit on a GPU; inputs go there, logits and hidden states come back to the
        # CPU, where the drafters, retrieval and verification run.
        self.device = next(model.parameters()).device
        fp32 = self.dtype == torch.float32
        self.weights = weights or str(self.dtype).replace("torch.", "")
        # Grouped key/value heads attended without copying them per query head (core/attention.py): its own curve
        runtime = torch_runtime() + ("|grouped-sdpa" if use_grouped_attention(model) else "") + packed_runtime(model)
        self.capabilities = Capabilities("transformers", self.weights, runtime,
                                         str(self.device), hidden_states=True, references=("hf_assisted",),
                                         tie_gap=1e-3 if fp32 else 0.5,
                                         tie_note=f"a tree forward and a one-token forward round differently in "
                                                  f"{str(self.dtype).replace('torch.', '')}; --dtype float32 is the "
                                                  "exactness reference")
        self.reset()

    def clone(self) -> "TargetBackend":
        """An empty backend on the same weights (a drafter's own cache)."""
        return TargetBackend(self.model, self.draft_loader, self.weights)

    def draft_backend(self, model: str) -> "TargetBackend":
        if self.draft_loader is None:
            raise SpecgraftError(f"this backend cannot load draft model '{model}' by name; pass the model loaded")
        return self.draft_loader(model)

    new_cache: Callable[[object], DynamicCache] = staticmethod(positional_cache)  # written by position

    def reset(self) -> None:
        self.cache: DynamicCache | None = None
        self.lengths: list[int] = []  # committed tokens per row (= the position of its next root)
        self._col0 = 0  # the first tree column of the last verify


    def _forward(self, ids, positions, mask, hidden_layers, logits_to_keep: int = 0):
        dev = self.device
        return self.model(input_ids=ids.to(dev), position_ids=positions.to(dev), attention_mask=mask.to(dev),
                          use_cache=True, **{self._cache_kw: self.cache}, logits_to_keep=logits_to_keep,
                          output_hidden_states=bool(hidden_layers))

    # -- rows joining and leaving ------------------------------------------------------------------------
    @torch.inference_mode()
    def add(self, ids: torch.Tensor, all_logits: bool | torch.Tensor = False,
            hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Prefill ``ids: [T]`` alone and append it as the last row; logits ``[T, V]`` (``all_logits=True``),
        ``[len(rows), V]`` (a tensor of positions ``rows``) or ``[1, V]`` (the last position); hidden states
        ``[T, H]``."""
        cache = self.new_cache(self.model.config)
        keep = all_logits.to(self.device) if isinstance(all_logits, torch.Tensor) else (0 if all_logits else 1)
        out = self.model(input_ids=ids.unsqueeze(0).to(self.device), use_cache=True, **{self._cache_kw: cache},
                         logits_to_keep=keep, output_hidden_states=bool(hidden_layers))
        if self.cache is None:
            self.cache = cache
        else:  # pad the narrower side with holes, then stack the new row under the others
            width = max(self.cache.layers[0].keys.shape[2], int(ids.shape[0]))
            for mine, new in zip(self.cache.layers, cache.layers):
                mine.keys = torch.cat([_pad(mine.keys, width), _pad(new.keys, width)])
                mine.values = torch.cat([_pad(mine.values, width), _pad(new.values, width)])
        self.lengths.append(int(ids.shape[0]))
        hidden = {i: out.hidden_states[i][0].cpu() for i in hidden_layers} if hidden_layers else None
        return VerifyOutput(out.logits[0].cpu(), hidden)

    def prefill(self, ids: torch.Tensor, all_logits: bool = False, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Drop every row and cache ``ids`` as the only one."""
        self.reset()
        return self.add(ids, all_logits, hidden_layers)

    def remove(self, row: int) -> None:
        """Drop a row (a finished or aborted request); later rows move up by one."""
        del self.lengths[row]
        if not self.lengths:
            self.cache = None
            return
        keep = torch.tensor([i for i in range(len(self.lengths) + 1) if i != row], device=self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, keep)[:, :, : self.width]
            layer.values = layer.values.index_select(0, keep)[:, :, : self.width]

    # -- one verification step for every row -----------------------------------------------------------
    @torch.inference_mode()
    def verify_batch(self, trees: list[Tree], hidden_layers: tuple[int, ...] = ()) -> list[VerifyOutput]:
        """One forward over ``B x W`` slots, ``W`` = the largest tree; smaller trees are padded with dummy
        nodes that see only themselves (never read). Row ``i``'s outputs are ``[W_i, ...]``."""
        if len(trees) != self.rows:
            raise ValueError(f"{len(trees)} trees for {self.rows} cache rows")
        b, length = self.rows, self.cache.layers[0].keys.shape[2]
        w = max(t.size for t in trees)
        lengths = torch.tensor(self.lengths)
        ids = torch.zeros(b, w, dtype=torch.long)
        pos = lengths.unsqueeze(1).repeat(1, w)
        vis = torch.zeros(b, w, length + w, dtype=torch.bool)
        vis[:, :, :length] = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(1)
        vis[:, :, length:] = torch.eye(w, dtype=torch.bool)
        for i, t in enumerate(trees):
            n = t.size
            ids[i, :n] = t.tokens
            pos[i, :n] += t.depth
            vis[i, :n, length: length + n] = t.ancestors
            vis[i, n:, :length] = False
        mask = torch.zeros(b, 1, w, length + w, dtype=self.dtype).masked_fill_(~vis.unsqueeze(1), self.neg)
        out = self._forward(ids, pos, mask, hidden_layers)
        self._col0 = length
        logits = out.logits.cpu()
        hidden = {h: out.hidden_states[h].cpu() for h in hidden_layers}
        return [VerifyOutput(logits[i, : t.size], {h: hidden[h][i, : t.size] for h in hidden_layers} or None)
                for i, t in enumerate(trees)]

    @torch.inference_mode()
    def commit_batch(self, accepted: list[list[int]]) -> None:
        """Per row, keep the root and the accepted path (node indices, root first); drop the other slots."""
        rows, dst, src = [], [], []
        for i, acc in enumerate(accepted):
            for j, node in enumerate(acc):
                if self.lengths[i] + j != self._col0 + node:  # a chain prefix of the longest row is in place
                    rows.append(i)
                    dst.append(self.lengths[i] + j)
                    src.append(self._col0 + node)
            self.lengths[i] += len(acc)
        width = self.width
        dev = self.device
        r, d, s = (torch.tensor(x, dtype=torch.long, device=dev) for x in (rows, dst, src))
        for layer in self.cache.layers:
            if rows:
                layer.keys[r, :, d] = layer.keys[r, :, s]
                layer.values[r, :, d] = layer.values[r, :, s]
            layer.keys = layer.keys[:, :, :width]
            layer.values = layer.values[:, :, :width]

    # -- the single-sequence API (one row) ---------------------------------------------------------------
    def verify(self, tree: Tree, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """One forward over all ``W`` tree nodes; logits at every node (and chosen hidden states)."""
        return self.verify_batch([tree], hidden_layers)[0]

    def commit(self, accepted: list[int]) -> None:
        self.commit_batch([accepted])

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Append ``n`` speculative nodes after the committed prefix and earlier speculative ones.

        ``visible: bool[n, A + n]`` says which of the ``A`` already appended speculative positions and of
        the ``n`` new ones each new node attends to (the prefix is always visible). Used by drafters that
        grow a tree level by level in their own cache; :meth:`truncate` drops the speculation afterwards.
        """
        p, n = self.prefix_len, tokens.shape[0]
        mask = torch.zeros(1, 1, n, self.cache.get_seq_length() + n, dtype=self.dtype)
        mask[0, 0, :, p:].masked_fill_(~visible, self.neg)
        return self._forward(tokens.unsqueeze(0), positions.unsqueeze(0), mask, ()).logits[0].cpu()

    def truncate(self, length: int) -> None:
        """Drop cached positions from ``length`` on (a drafter rolling back its own speculation)."""
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]
        self.lengths[0] = min(self.prefix_len, length)


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, h, t, d]`` -> ``[b, h, width, d]`` with zero columns (holes) on the right."""
    return x if x.shape[2] == width else torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[2]))
