"""llama.cpp target backend: the same verify / commit contract as the transformers one, on a GGUF model.

It drives llama-cpp-python's low-level API (one ``llama_context`` with a unified KV cache). A tree is verified
in ONE ``llama_decode``: every node is a batch token at position ``P + depth``, and llama.cpp's attention mask
comes from *sequence ids*, not from a mask we pass, so each node carries the ids of the leaves below it::

    tree (root r):      r              seq ids:  r  {0, 7, 8}     (0 = the row's home sequence,
                       / \\                      a  {0, 7}          7 and 8 borrowed for this step)
                      a   b                      b  {8}
                     / \\                        c  {0}
                    c   d                        d  {7}

llama.cpp lets a token see the cached cells of its *first* sequence id at positions <= its own. Each leaf's
sequence is exactly prefix + its root-to-leaf path, so a node sees the committed prefix, its ancestors and
itself, as the transformers backend's tree mask does. Before the decode every borrowed sequence gets the
prefix (``seq_cp`` adds an id to cells; nothing is copied). Commit keeps one leaf sequence that holds the
accepted path, renames it to the row's home sequence, drops everything else (``seq_rm``) and trims the tail
past the accepted nodes, so the next step sees exactly prefix + accepted tokens.

Rejected nodes that sit before the last accepted one (a batch fills cells in order) are not freed: their cells
move to the row's *ballast* sequence, which no token ever attends to (those after it are freed: with one row the
holes are at the end; with several, the next rows' cells follow, and the order holds only up to that). Freed cells would be reused by the next tokens, placing a token's cell before cells of earlier positions;
attention then sums in another order, and on quantised weights (activations re-quantised to 8 bits at every
matmul) that reordering moves logits by up to ~1 (measured; docs/backends.md). Kept in place, every step
reads its cells in the order llama.cpp AR would, so verification logits equal AR's bit for bit wherever the
kernels are batch-shape invariant. For the same reason a row that leaves while others remain hands its cells
to a shared *graveyard* sequence instead of freeing them (its cells may sit before another row's newest ones).
Ballast and graveyard are freed when no row is left, or when either exceeds a quarter of the cache (from then
on the rows still running are exact only up to that noise).

Rows (requests) each own a home and a ballast sequence; the borrowed ids of a step come from one pool of
``LLAMA_MAX_SEQ`` = 256 (one kept for the graveyard, two held by each row): the leaves of all trees of one step,
less one per tree, must fit in what is free. Limits (tree size, ids, KV cells) are checked before a step touches
the cache; a step whose trees exceed ``n_batch`` tokens is split by rows into consecutive decodes. When the cache
runs short, ballast and graveyard are freed first. Hidden states (EAGLE-3 features) come from
``llamacpp_features``: the input of chosen layers at every token of a decode.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ..core.backend import Capabilities, RowLengths, VerifyOutput
from ..core.tree import Tree
from ..errors import SpecgraftError
from .llamacpp_features import EvalTap, LayerInputs, architecture, llama_lib, make_tap
from .packed import bf16_path

MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ
GRAVE = MAX_SEQ - 1  # the graveyard sequence: cells of rows that left while others ran (never borrowed)


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as err:
        raise SpecgraftError("the llama.cpp backend needs llama-cpp-python: pip install 'specgraft[llamacpp]' (build it "
                             "with the CMAKE_ARGS in the README)") from err
    return llama_cpp


_LOG_CB = None


def _quiet(lc) -> None:
    """Route llama.cpp's log to stderr at error level only (it prints every tensor at load otherwise)."""
    global _LOG_CB
    if _LOG_CB is None:
        @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        def cb(level, text, _user):
            if level == 4 and os.environ.get("SPECGRAFT_LLAMA_LOG") is None:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode(errors="replace"))
            elif os.environ.get("SPECGRAFT_LLAMA_LOG"):
                sys.stderr.write(text.decode(errors="replace"))

        _LOG_CB = cb
        lc.llama_log_set(_LOG_CB, None)
        lc.llama_backend_init()


@dataclass(frozen=True)
class LlamaSettings:
    """Context settings (docs/backends.md measures them here)."""

    n_ctx: int = 8192  # cells shared by every row (unified KV), rejected tree nodes' ballast included
    n_batch: int = 512  # tokens per llama_decode call (prefill is chunked by it)
    n_ubatch: int = 512
    n_threads: int = 0  # 0: every core
    flash_attn: int = -1  # -1 auto, 0 off, 1 on


class LlamaModel:
    """Loaded GGUF weights, shared by every context (backend) made from them."""

    def __init__(self, path: Path, settings: LlamaSettings = LlamaSettings(), weights: str = "gguf"):
        self.lc = lc = import_llama_cpp()
        _quiet(lc)
        params = lc.llama_model_default_params()
        params.n_gpu_layers = 0
        self.path, self.settings, self.weights = Path(path), settings, weights
        self.ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise SpecgraftError(f"llama.cpp could not load '{path}'")
        if lc.llama_model_is_recurrent(self.ptr) or lc.llama_model_is_hybrid(self.ptr):
            raise SpecgraftError(f"'{path}' is a recurrent or hybrid model: its state cannot be cut back to an "
                                 "accepted path, so tree verification does not support it")
        vocab = lc.llama_model_get_vocab(self.ptr)
        self.vocab_size = int(lc.llama_vocab_n_tokens(vocab))
        self.eos_ids = {int(t) for t in (lc.llama_vocab_eos(vocab), lc.llama_vocab_eot(vocab)) if t >= 0}
        self.n_ctx_train = int(lc.llama_model_n_ctx_train(self.ptr))
        self.n_layer, self.n_embd = int(lc.llama_model_n_layer(self.ptr)), int(lc.llama_model_n_embd(self.ptr))
        self.architecture = architecture(lc, self.ptr)
        self._embeddings: torch.nn.Embedding | None = None

    # -- what an EAGLE-3 head reads of its target (``eagle.checkpoint.load_head``) ----------------------------
    @property
    def head_dtype(self) -> torch.dtype:
        """Heads are trained in bf16 and run on the CPU beside llama.cpp: in bf16 where oneDNN has a bf16 path,
        in fp32 on an AVX2-only CPU, where a bf16 product costs about twice an fp32 one (drafts only: outputs
        are the target's either way)."""
        return torch.bfloat16 if bf16_path() else torch.float32

    @property
    def config(self):
        return SimpleNamespace(hidden_size=self.n_embd, vocab_size=self.vocab_size, num_hidden_layers=self.n_layer,
                               model_type=self.architecture)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        """The token embedding, dequantised by llama.cpp itself (``llama_model_get_tok_embd``, fp32)."""
        if self._embeddings is None:
            fn = getattr(llama_lib(), "_Z24llama_model_get_tok_embdPK11llama_modelPf", None)
            if fn is None:
                raise SpecgraftError("this libllama does not export llama_model_get_tok_embd (llama-cpp-python "
                                     "0.3.36 does): an EAGLE-3 head needs the target's token embedding")
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_uint32
            out = np.empty((self.vocab_size, self.n_embd), dtype=np.float32)
            if fn(self.ptr, out.ctypes.data) != out.size:
                raise SpecgraftError(f"llama.cpp could not dequantise the token embedding of '{self.path}'")
            # kept in bf16, the heads' dtype (fp32 would hold ~1 GB for a 150k x 1.5k vocabulary)
            self._embeddings = torch.nn.Embedding.from_pretrained(torch.from_numpy(out).to(self.head_dtype))
        return self._embeddings

    def __del__(self, finalizing=sys.is_finalizing):  # bound now: at exit the module's globals may be None
        if getattr(self, "ptr", None) and not finalizing():  # at exit llama_cpp's bindings are gone first
            self.lc.llama_model_free(self.ptr)
            self.ptr = None


class LlamaCppBackend(RowLengths):
    """B rows over one llama.cpp context; the interface of :class:`specgraft.core.backend.TargetBackend`."""

    dtype = torch.float32  # llama.cpp returns fp32 logits whatever the weights' quantisation

    def __init__(self, model: LlamaModel, settings: LlamaSettings | None = None, hidden: bool = True):
        """``hidden=False``: a context that never returns hidden states (a draft model's), so it carries no
        evaluation callback."""
        lc, self.model, self.lc = model.lc, model, model.lc
        s = self.settings = settings or model.settings
        if min(s.n_batch, s.n_ubatch) < MAX_SEQ:  # llama.cpp aborts the process otherwise (graph reservation)
            raise SpecgraftError(f"llama.cpp backend: n_batch and n_ubatch must be >= {MAX_SEQ} (n_seq_max)")
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = s.n_ctx, s.n_batch, s.n_ubatch
        params.n_seq_max = MAX_SEQ
        params.kv_unified = True  # every sequence's cells in one buffer: a shared prefix is stored once
        params.flash_attn_type = s.flash_attn
        threads = s.n_threads or os.cpu_count() or 1
        params.n_threads = params.n_threads_batch = threads
        self.hidden, self.no_hidden, tap = hidden, "a context made without hidden states (a draft model's)", None
        if hidden:
            try:
                tap, self.no_hidden = make_tap(lc, model.architecture, model.n_layer, model.n_embd), ""
            except SpecgraftError as err:
                self.no_hidden = str(err)
        if isinstance(tap, EvalTap):
            tap.install(params)
        self.ctx = lc.llama_init_from_model(model.ptr, params)
        if not self.ctx:
            raise SpecgraftError("llama.cpp could not create a context (out of memory?)")
        self._tap = LayerInputs(self.ctx, model.n_layer, model.n_embd) if tap is LayerInputs else tap
        self.mem = lc.llama_get_memory(self.ctx)
        self.vocab_size, self.eos_ids = model.vocab_size, model.eos_ids
        self.max_positions = min(s.n_ctx, model.n_ctx_train or s.n_ctx)
        self._batch = lc.llama_batch_init(s.n_batch, 0, MAX_SEQ)
        version = getattr(import_llama_cpp(), "__version__", "?")
        self.capabilities = Capabilities("llamacpp", model.weights, f"threads={threads}|llama_cpp={version}", "cpu",
                                         hidden_states=self._tap is not None, references=("llama_pld", "llama_server"),
                                         label="llama.cpp", row_feeds=True,
                                         tie_gap=1.0, tie_note="llama.cpp's quantised kernels round a tree decode "
                                                               "and a one-token decode differently (docs/backends.md)")
        self.reset()

    def __del__(self, finalizing=sys.is_finalizing):
        lc = getattr(self, "lc", None)
        if lc is not None and getattr(self, "ctx", None) and not finalizing():
            lc.llama_batch_free(self._batch)
            lc.llama_free(self.ctx)
            self.ctx = None

    def clone(self) -> "LlamaCppBackend":
        """An empty backend on the same weights (a drafter's own cache)."""
        return LlamaCppBackend(self.model, self.settings, self.hidden)

    def draft_backend(self, model: str) -> "LlamaCppBackend":
        """A draft model's GGUF (a registry name or a ``.gguf`` path) on llama.cpp, with these settings."""
        from . import llamacpp_backend

        return llamacpp_backend(model, settings=self.settings, hidden=False)[0]

    def reset(self) -> None:
        self.lc.llama_memory_clear(self.mem, True)
        self.lengths: list[int] = []
        self.home: list[int] = []  # each row's sequence id: exactly its committed prefix
        self.ballast: list[int] = []  # each row's sequence id holding its rejected tree nodes' cells
        self._ballast_cells: list[int] = []
        self._free = list(range(GRAVE - 1, -1, -1))  # pop() hands out the lowest id first
        self._grave_cells = 0
        # per row, of the last verify: (a sequence through each node, the borrowed ids, each node's depth)
        self._steps: list[tuple[list[int], list[int], list[int]]] = []
        self._spec: list[list[tuple[int, int]]] = []  # per row, extend's (sequence, position) of each spec. node

    def capacity(self) -> dict[str, int]:
        """KV cells (ballast and graveyard are reclaimable, so not counted) and sequence ids (all but the
        graveyard's)."""
        return {"kv_cells": self.settings.n_ctx, "seq_ids": GRAVE}

    def reservation(self, prompt_len: int, max_new: int, budget: int) -> dict[str, int]:
        """A row holds its prefix and output, a tree of ``budget + 1`` nodes, its home and ballast ids, and
        one borrowed id per leaf but the first (``budget`` nodes have at most ``budget`` leaves)."""
        return {"kv_cells": prompt_len + max_new + budget + 1, "seq_ids": 2 + max(budget - 1, 0)}

    def _used(self) -> int:
        """Cells in use (committed prefixes, ballast, graveyard): what the shared cache must hold before a step."""
        return sum(self.lengths) + sum(self._ballast_cells) + self._grave_cells

    def _make_room(self, need: int) -> None:
        """Free ballast and graveyard when ``need`` more cells would not fit; refuse when they still do not."""
        if self._used() + need <= self.settings.n_ctx:
            return
        self.lc.llama_memory_seq_rm(self.mem, GRAVE, -1, -1)
        self._grave_cells = 0
        for i, b in enumerate(self.ballast):
            self.lc.llama_memory_seq_rm(self.mem, b, -1, -1)
            self._ballast_cells[i] = 0
        if self._used() + need > self.settings.n_ctx:
            raise SpecgraftError(f"llama.cpp KV cache full: {self._used()} cells in use + {need} needed > n_ctx "
                                 f"{self.settings.n_ctx} (fewer or shorter requests at once, or a larger n_ctx)")

    # -- llama.cpp calls ------------------------------------------------------------------------------------
    def _borrow(self, n: int) -> list[int]:
        if n > len(self._free):
            raise SpecgraftError(f"llama.cpp backend: this step needs {n} more sequence ids than the {len(self._free)} "
                                 f"free of {MAX_SEQ} (trees with fewer leaves, or fewer requests at once)")
        return [self._free.pop() for _ in range(n)]

    def _release(self, seqs) -> None:
        for s in seqs:
            self.lc.llama_memory_seq_rm(self.mem, s, -1, -1)
            self._free.append(s)

    def _decode(self, tokens, positions, seqs: list[list[int]], outputs,
                hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor] | None]:
        """One ``llama_decode`` over ``n <= n_batch`` tokens: logits ``[sum(outputs), V]`` (fp32) and, for
        ``hidden_layers``, the input of each of those layers at every token ``{layer: [n, H]}``."""
        n, b = len(tokens), self._batch
        if hidden_layers:  # callers checked the layers before touching the cache (_check_hidden)
            self._tap.want(hidden_layers)
        if self._tap is not None:
            self._tap.begin(bool(hidden_layers))
        b.n_tokens = n
        np.ctypeslib.as_array(b.token, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(b.pos, shape=(n,))[:] = positions
        np.ctypeslib.as_array(b.logits, shape=(n,))[:] = outputs
        counts = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))
        for i, ids in enumerate(seqs):
            counts[i] = len(ids)
            row = b.seq_id[i]
            for j, s in enumerate(ids):
                row[j] = s
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc} ({'no KV cell free: raise n_ctx' if rc == 1 else 'see the llama.cpp log'})")
        hidden = self._tap.take(hidden_layers, n) if hidden_layers else None
        k = int(np.count_nonzero(outputs))
        if k == 0:
            return torch.empty(0, self.vocab_size), hidden
        ptr = self.lc.llama_get_logits(self.ctx)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(k, self.vocab_size)).copy()), hidden

    def _check_hidden(self, layers) -> None:
        """Before a step touches anything: the tap exists and reads those layers."""
        if self._tap is None:
            raise SpecgraftError(f"the llama.cpp backend cannot expose this model's hidden states ({self.no_hidden}); "
                                 "EAGLE-3 heads need them: use --backend transformers for eagle and graft on the head")
        self._tap.check(layers)

    # -- rows joining and leaving ---------------------------------------------------------------------------
    def add(self, ids: torch.Tensor, all_logits: bool | torch.Tensor = False,
            hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        """Prefill ``ids: [T]`` (in ``n_batch`` chunks) as a new last row; logits (and hidden states at every
        prompt token) as the transformers backend's."""
        if hidden_layers:
            self._check_hidden(hidden_layers)
        toks = ids.tolist()
        t = len(toks)
        if t + 1 > self.max_positions:
            raise SpecgraftError(f"prompt too long: {t} tokens for a llama.cpp context of {self.max_positions}")
        want = np.zeros(t, dtype=np.int8)
        if isinstance(all_logits, torch.Tensor):
            want[all_logits.numpy()] = 1
        elif all_logits:
            want[:] = 1
        else:
            want[-1] = 1
        self._make_room(t)
        home, ballast = self._borrow(2)
        chunks, step = [], self.settings.n_batch
        try:
            for a in range(0, t, step):
                chunks.append(self._decode(toks[a: a + step], np.arange(a, min(t, a + step)),
                                           [[home]] * min(step, t - a), want[a: a + step], hidden_layers))
        except Exception:
            self._release([home, ballast])
            raise
        self.home.append(home)
        self.ballast.append(ballast)
        self._ballast_cells.append(0)
        self.lengths.append(t)
        self._steps.append(([], [], []))
        self._spec.append([])
        hidden = {i: torch.cat([c[1][i] for c in chunks]) for i in hidden_layers} if hidden_layers else None
        return VerifyOutput(torch.cat([c[0] for c in chunks]), hidden)

    def prefill(self, ids: torch.Tensor, all_logits: bool = False, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        self.reset()
        return self.add(ids, all_logits, hidden_layers)

    def remove(self, row: int) -> None:
        home, ballast = self.home[row], self.ballast[row]
        if self.rows > 1:  # others run on: keep the cells in place (module docstring)
            cells = self.lengths[row] + self._ballast_cells[row]
            if self._grave_cells + cells > self.settings.n_ctx // 4:
                self.lc.llama_memory_seq_rm(self.mem, GRAVE, -1, -1)
                self._grave_cells = 0
            self.lc.llama_memory_seq_cp(self.mem, home, GRAVE, -1, -1)
            self.lc.llama_memory_seq_cp(self.mem, ballast, GRAVE, -1, -1)
            self._grave_cells += cells
        else:
            self.lc.llama_memory_seq_rm(self.mem, GRAVE, -1, -1)
            self._grave_cells = 0
        self._release([home, ballast, *self._steps[row][1], *(s for s, _ in self._spec[row])])
        del self.lengths[row], self.home[row], self.ballast[row], self._ballast_cells[row], self._steps[row]
        del self._spec[row]

    # -- one verification step for every row ----------------------------------------------------------------
    def verify_batch(self, trees: list[Tree], hidden_layers: tuple[int, ...] = ()) -> list[VerifyOutput]:
        """One ``llama_decode`` for all rows' trees when they fit in ``n_batch`` tokens; otherwise rows are split
        into consecutive decodes (rows never see each other's cells, so the results are the same)."""
        if hidden_layers:
            self._check_hidden(hidden_layers)
        if len(trees) != self.rows:
            raise ValueError(f"{len(trees)} trees for {self.rows} cache rows")
        # every limit is checked before any sequence is borrowed or copied (no side effects on refusal)
        big = max((t.size for t in trees), default=0)
        if big > self.settings.n_batch:
            raise SpecgraftError(f"llama.cpp backend: a tree of {big} nodes exceeds n_batch {self.settings.n_batch}")
        leaves = sum(sum(1 for k in t.children if not k) - 1 for t in trees)
        stale = sum(len(step[1]) for step in self._steps)  # ids an uncommitted verify still holds (freed below)
        if leaves > len(self._free) + stale:
            raise SpecgraftError(f"llama.cpp backend: this step's trees need {leaves} more sequence ids than the "
                                 f"{len(self._free)} free (smaller trees, or fewer requests at once)")
        for i in range(self.rows):  # an earlier verify never committed: drop it before home is copied
            self._drop_uncommitted(i)
        self._make_room(sum(t.size for t in trees))
        groups, cur, size = [], [], 0
        for i, t in enumerate(trees):
            if cur and size + t.size > self.settings.n_batch:
                groups.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += t.size
        groups.append(cur)
        out: list[VerifyOutput] = []
        for group in groups:
            toks, pos, seqs = [], [], []
            for i in group:
                t = trees[i]
                seqs += self._assign(i, t)
                toks += t.tokens.tolist()
                pos += (t.depth + self.lengths[i]).tolist()
            logits, hidden = self._decode(toks, pos, seqs, np.ones(len(toks), dtype=np.int8), hidden_layers)
            sizes = [trees[i].size for i in group]
            parts = {h: x.split(sizes) for h, x in hidden.items()} if hidden else {}
            out += [VerifyOutput(x, {h: parts[h][j] for h in parts} or None)
                    for j, x in enumerate(logits.split(sizes))]
        return out

    def _assign(self, row: int, tree: Tree) -> list[list[int]]:
        """Give every leaf a sequence (the home one first) holding the prefix; a node's ids = its leaves'."""
        kids = tree.children
        leaves = [n for n in range(tree.size) if not kids[n]]
        home = self.home[row]
        borrowed = self._borrow(len(leaves) - 1)
        for s in borrowed:
            self.lc.llama_memory_seq_cp(self.mem, home, s, -1, -1)
        node_seqs: list[list[int]] = [[] for _ in range(tree.size)]
        parents = tree.parent_list
        for leaf, s in zip(leaves, [home, *borrowed]):
            n = leaf
            while n >= 0:
                node_seqs[n].append(s)
                n = parents[n]
        self._steps[row] = ([ns[0] for ns in node_seqs], borrowed, tree.depth.tolist())
        return node_seqs

    def _drop_uncommitted(self, row: int) -> None:
        """Release the borrowed ids of a verify that was never committed (a step that raised in between) and
        trim home's uncommitted tail, so that the next borrowed copies of home hold exactly its prefix."""
        if self._steps[row][0]:
            self._release(self._steps[row][1])
            self.lc.llama_memory_seq_rm(self.mem, self.home[row], self.lengths[row], -1)
            self._steps[row] = ([], [], [])

    def commit_batch(self, accepted: list[list[int]]) -> None:
        """Per row, keep the root and the accepted path (node indices, root first); drop the other nodes."""
        for i, acc in enumerate(accepted):
            first, borrowed, depth = self._steps[i]
            home, keep = self.home[i], first[acc[-1]]  # a leaf sequence through the last accepted node
            holes = sorted(set(range(acc[-1])) - set(acc))  # rejected nodes before the last accepted one
            if holes:  # their cells stay, as ballast (module docstring)
                if self._ballast_cells[i] + len(holes) > self.settings.n_ctx // 4:
                    self.lc.llama_memory_seq_rm(self.mem, self.ballast[i], -1, -1)
                    self._ballast_cells[i] = 0
                for n in holes:  # a leaf sequence holds one node per position: (sequence, position) is its cell
                    pos = self.lengths[i] + depth[n]
                    self.lc.llama_memory_seq_cp(self.mem, first[n], self.ballast[i], pos, pos + 1)
                self._ballast_cells[i] += len(holes)
            self._release([s for s in borrowed if s != keep])
            if keep != home:  # home leaves the tree's cells, then joins the kept path's
                start = self.lengths[i]
                self.lc.llama_memory_seq_rm(self.mem, home, start, -1)
                self.lc.llama_memory_seq_cp(self.mem, keep, home, start, -1)
                self._release([keep])
            self.lengths[i] += len(acc)
            self.lc.llama_memory_seq_rm(self.mem, home, self.lengths[i], -1)
            self._steps[i] = ([], [], [])

    # -- the single-sequence API (one row: a draft model's own cache, the latency probe) ---------------------
    def verify(self, tree: Tree, hidden_layers: tuple[int, ...] = ()) -> VerifyOutput:
        return self.verify_batch([tree], hidden_layers)[0]

    def commit(self, accepted: list[int]) -> None:
        self.commit_batch([accepted])

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Append ``n`` speculative nodes to the one row; ``visible: bool[n, A + n]`` over the ``A`` appended before
        and the new ones (a new node may see only itself among the new ones)."""
        return self.extend_rows([0], [tokens], [positions], [visible])[0]

    def extend_rows(self, rows: list[int], tokens: list[torch.Tensor], positions: list[torch.Tensor],
                    visible: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`extend` for several rows in one decode (split only past ``n_batch``): a draft model's tree level
        for every request sharing its context. Each node gets its own sequence: its row's prefix plus the cells
        of that row's earlier nodes it sees. All or nothing: on failure no row keeps a new node."""
        sizes = [int(t.shape[0]) for t in tokens]
        if len(set(rows)) != len(rows):
            raise ValueError(f"llama.cpp extend: rows {rows} name a row twice")
        for r, n, vis in zip(rows, sizes, visible):
            a = len(self._spec[r])
            if tuple(vis.shape) != (n, a + n) or vis[:, a:].ne(torch.eye(n, dtype=torch.bool)).any():
                raise ValueError("llama.cpp extend: visible must be [n, A + n] and a new node may see only itself "
                                 "among the nodes appended with it")
        if any(not 0 < n <= self.settings.n_batch for n in sizes):
            raise SpecgraftError(f"llama.cpp extend: {sizes} nodes per row (each 1..n_batch {self.settings.n_batch})")
        if sum(sizes) > len(self._free):
            raise SpecgraftError(f"llama.cpp extend: {sum(sizes)} nodes need as many sequence ids, "
                                 f"{len(self._free)} are free (smaller draft trees, or fewer requests per context)")
        self._make_room(sum(sizes))
        placed: list[tuple[int, list[int], list[int]]] = []  # (row, its new sequences, their positions)
        for r, n, pos, vis in zip(rows, sizes, positions, visible):
            new = self._borrow(n)
            placed.append((r, new, pos.tolist()))
            for j, s in enumerate(new):
                self.lc.llama_memory_seq_cp(self.mem, self.home[r], s, -1, -1)
                for k in vis[j, : len(self._spec[r])].nonzero().flatten().tolist():
                    ks, kp = self._spec[r][k]
                    self.lc.llama_memory_seq_cp(self.mem, ks, s, kp, kp + 1)
        groups, size = [[]], 0  # consecutive rows, at most n_batch nodes per decode
        for j, n in enumerate(sizes):
            if groups[-1] and size + n > self.settings.n_batch:
                groups.append([])
                size = 0
            groups[-1].append(j)
            size += n
        out: list[torch.Tensor] = []
        try:
            for group in groups:
                toks = [t for j in group for t in tokens[j].tolist()]
                pos = [p for j in group for p in placed[j][2]]
                seqs = [[s] for j in group for s in placed[j][1]]
                logits, _ = self._decode(toks, pos, seqs, np.ones(len(toks), dtype=np.int8))
                out += list(logits.split([sizes[j] for j in group]))
        except Exception:
            self._release([s for _, new, _ in placed for s in new])
            raise
        for r, new, pos in placed:
            self._spec[r] += list(zip(new, pos))
        return out

    def feed_rows(self, rows: list[int], chains: list[list[int]]) -> torch.Tensor:
        """Append ``chains[j]`` to row ``rows[j]``'s committed prefix, for all ``j`` in one decode (split only past
        ``n_batch``): a draft model's feeds for every request sharing its context. Returns each chain's last
        logits ``[len(rows), V]``. Rows never see each other's cells."""
        if any(not 0 < len(c) <= self.settings.n_batch for c in chains):
            raise SpecgraftError(f"llama.cpp feed: chains of {[len(c) for c in chains]} tokens (each 1..n_batch)")
        for i in rows:
            self._drop_uncommitted(i)
        self._make_room(sum(map(len, chains)))
        before = {r: self.lengths[r] for r in rows}
        out, group, size = [], [], 0
        try:  # all or nothing: a failed decode leaves every row as it was (its caller may retry row by row)
            for i, chain in [*zip(rows, chains), (None, [])]:
                if group and (i is None or size + len(chain) > self.settings.n_batch):
                    out.append(self._feed_group(group))
                    group, size = [], 0
                if i is not None:
                    group.append((i, chain))
                    size += len(chain)
        except Exception:
            for r, n in before.items():
                self.truncate_row(r, n)
            raise
        return torch.cat(out)

    def _feed_group(self, group: list[tuple[int, list[int]]]) -> torch.Tensor:
        toks, pos, seqs, want = [], [], [], []
        for r, c in group:
            toks += c
            pos += range(self.lengths[r], self.lengths[r] + len(c))
            seqs += [[self.home[r]]] * len(c)
            want += [0] * (len(c) - 1) + [1]
        logits = self._decode(toks, pos, seqs, np.array(want, dtype=np.int8))[0]
        for r, c in group:
            self.lengths[r] += len(c)
        return logits

    def truncate_row(self, row: int, length: int) -> None:
        """Drop row ``row``'s speculative nodes (extend's, an uncommitted verify's) and its cached positions from
        ``length`` on."""
        self._release([s for s, _ in self._spec[row]] + self._steps[row][1])
        self._spec[row], self._steps[row] = [], ([], [], [])
        self.lc.llama_memory_seq_rm(self.mem, self.home[row], length, -1)
        self.lengths[row] = min(self.lengths[row], length)

    def truncate(self, length: int) -> None:
        """:meth:`truncate_row` of the one row."""
        if self.rows != 1:
            raise ValueError(f"truncate needs exactly one row, the cache has {self.rows}")
        self.truncate_row(0, length)

