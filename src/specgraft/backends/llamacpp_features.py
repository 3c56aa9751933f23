"""Hidden states out of llama.cpp: the input of chosen layers for every token of a decode (EAGLE-3 features).

Two taps, chosen by the model's architecture:

* ``LayerInputs`` - llama.cpp's own layer-input API, ``llama_set_embeddings_layer_inp(ctx, layer, on)`` and
  ``llama_get_embeddings_layer_inp(ctx, layer)`` (``src/llama-ext.h``; libllama exports them as C++ symbols,
  bound here by their mangled names). llama.cpp's EAGLE-3 drafter reads its features this way. Only graphs that
  publish their layer inputs support it; on any other one llama.cpp *aborts the process* when it is turned on,
  so it is used only for ``LAYER_INPUT_ARCHS``, the architectures whose graph builders publish them in the
  pinned llama.cpp.
* ``EvalTap`` - every other architecture: the context's graph-evaluation callback (``cb_eval``, what
  llama.cpp's imatrix tool uses) copies out the tensor each layer's output is named by (``l_out-<i>``; the input
  of layer ``i + 1``). The callback is asked about every graph node, so it costs a Python call per node on every
  decode of that context (measured in docs/backends.md); the context is created with it only when asked.

Either way a decode's features are ``[n_tokens, n_embd]`` fp32 per layer, tokens in batch order (the same
values as transformers' ``hidden_states[layer]`` up to the weights' quantisation).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ..errors import SpecgraftError

# Architectures whose graph builders set ``res->t_layer_inp`` in the llama.cpp llama-cpp-python 0.3.36 vendors
# (src/models/*.cpp); everything else goes through the eval callback.
LAYER_INPUT_ARCHS = frozenset({"llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "gemma4",
                               "minimax-m2", "openai-moe", "nemotron_h", "lfm2", "mimo2"})
SET_SYMBOL = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"  # (llama_context *, uint32_t, bool)
GET_SYMBOL = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"  # (llama_context *, uint32_t) -> float *


def llama_lib() -> ctypes.CDLL:
    """The libllama llama-cpp-python loaded (it honours ``LLAMA_CPP_LIB_PATH``): contexts it made are only
    valid for its own functions."""
    from llama_cpp import llama_cpp as lib

    return lib._lib


def _ggml_base() -> ctypes.CDLL:
    """libggml-base beside that libllama (already loaded by it: this only finds the handle)."""
    path = os.path.join(os.path.dirname(llama_lib()._name), "libggml-base.so")
    try:
        return ctypes.CDLL(path)
    except OSError as err:
        raise SpecgraftError(f"hidden states on llama.cpp: cannot open {path} ({err})") from err


def bind_layer_inputs():
    """``(set, get)`` bound to libllama's exported layer-input functions; one clear error when missing."""
    lib = llama_lib()
    try:
        set_fn, get_fn = getattr(lib, SET_SYMBOL), getattr(lib, GET_SYMBOL)
    except AttributeError as err:
        raise SpecgraftError("this libllama does not export llama_set/get_embeddings_layer_inp (llama-cpp-python "
                             "0.3.36 does): EAGLE-3 heads cannot read its hidden states") from err
    set_fn.argtypes, set_fn.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
    get_fn.argtypes, get_fn.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
    return set_fn, get_fn


def architecture(lc, model_ptr) -> str:
    buf = ctypes.create_string_buffer(128)
    n = lc.llama_model_meta_val_str(model_ptr, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n > 0 else ""


class LayerInputs:
    """llama.cpp's layer-input API on one context: ``want`` turns layers on, ``take(n)`` reads the last decode."""

    kind = "layer-input API"

    def __init__(self, ctx, n_layer: int, n_embd: int):
        self._set, self._get = bind_layer_inputs()
        self.ctx, self.n_layer, self.n_embd = ctx, n_layer, n_embd
        self.layers: set[int] = set()

    def check(self, layers) -> None:
        for i in layers:
            if not 0 <= i < self.n_layer:
                raise SpecgraftError(f"hidden state of layer {i} asked, the model has layers 0..{self.n_layer - 1}")

    def want(self, layers) -> None:
        for i in layers:
            if i not in self.layers:  # on for good: turning it off and on re-reserves llama.cpp's graph
                self._set(self.ctx, i, True)
                self.layers.add(i)

    def begin(self, reading: bool) -> None:
        """Called before every decode (the API needs nothing per decode)."""

    def take(self, layers, n_tokens: int) -> dict[int, torch.Tensor]:
        out = {}
        for i in layers:
            ptr = self._get(self.ctx, i)
            if not ptr:
                raise SpecgraftError(f"llama.cpp returned no input of layer {i} for the last decode")
            out[i] = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(n_tokens, self.n_embd)).copy())
        return out


class EvalTap:
    """The graph-evaluation callback on one context (set in its params before creation: ``install``)."""

    kind = "eval callback"

    def __init__(self, lc, n_layer: int, n_embd: int):
        base = _ggml_base()
        for fn, res in (("ggml_get_name", ctypes.c_char_p), ("ggml_nbytes", ctypes.c_size_t),
                        ("ggml_nelements", ctypes.c_int64)):
            getattr(base, fn).argtypes, getattr(base, fn).restype = [ctypes.c_void_p], res
        get = base.ggml_backend_tensor_get
        get.argtypes, get.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t], None
        self.base, self.n_layer, self.n_embd = base, n_layer, n_embd
        self.names: dict[bytes, int] = {}  # tensor name -> the layer whose input it is
        self.found: dict[int, list[np.ndarray]] = {}  # per layer, one block per micro-batch of the decode
        self.active = False  # copy only in decodes whose features are asked for
        self.error = ""  # a problem met inside the callback (an exception cannot cross the C boundary)

        def callback(tensor, ask, _user):
            if not self.active:
                return False
            layer = self.names.get(base.ggml_get_name(tensor))
            if layer is None:
                return False
            if ask:
                return True
            n = base.ggml_nelements(tensor)
            if base.ggml_nbytes(tensor) != 4 * n or n % self.n_embd:  # fp32, [n_embd, n_tokens]
                self.error = f"llama.cpp's output of layer {layer - 1} is not fp32 [n_embd, tokens]"
                return True  # False would stop the graph: the decode's logits and cells must still be computed
            out = np.empty(n, dtype=np.float32)
            get(tensor, out.ctypes.data, 0, 4 * n)
            self.found.setdefault(layer, []).append(out.reshape(-1, self.n_embd))
            return True

        self._callback = lc.ggml_backend_sched_eval_callback(callback)  # kept alive as long as the context

    def install(self, params) -> None:
        params.cb_eval = self._callback
        params.cb_eval_user_data = None

    def want(self, layers) -> None:
        for i in layers:
            self.names[f"l_out-{i - 1}".encode()] = i

    def begin(self, reading: bool) -> None:
        """Before every decode: copy only when ``reading``, and nothing left from an earlier (failed) one."""
        self.active, self.found, self.error = reading, {}, ""

    def take(self, layers, n_tokens: int) -> dict[int, torch.Tensor]:
        if self.error:
            raise SpecgraftError(self.error)
        out = {}
        for i in layers:
            rows = np.concatenate(self.found[i]) if i in self.found else None
            if rows is None or rows.shape[0] != n_tokens:
                raise SpecgraftError(f"llama.cpp's eval callback did not deliver layer {i} for {n_tokens} tokens")
            out[i] = torch.from_numpy(rows)
        return out

    def check(self, layers) -> None:
        for i in layers:
            if not 1 <= i < self.n_layer:  # layer 0's input is the embedding, which no graph names per layer
                raise SpecgraftError(f"hidden state of layer {i} asked; the eval-callback tap reads layers "
                                     f"1..{self.n_layer - 1}")


def make_tap(lc, arch: str, n_layer: int, n_embd: int):
    """The tap this architecture supports: an ``EvalTap`` to install in the context's params, or the class
    ``LayerInputs`` (bound once the context exists). SpecgraftError when the library lacks the symbols."""
    if arch in LAYER_INPUT_ARCHS:
        bind_layer_inputs()  # fail here, before a context exists, when the symbols are missing
        return LayerInputs
    return EvalTap(lc, n_layer, n_embd)
