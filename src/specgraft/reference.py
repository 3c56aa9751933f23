"""Outside references: transformers' own assisted generation (``generate(assistant_model=...)``),
llama-cpp-python's own prompt lookup (``Llama(draft_model=LlamaPromptLookupDecoding(...))``) and llama.cpp's own
server with its speculation (``llama_server.py``).

Not one of our drafters: it runs HF's loop (its draft length heuristic, its cache) on the same prompts,
so a benchmark can show where our draft-model drafter stands against the library users already have.
Steps are counted with a forward hook on the target. HF's first call runs the prompt *and* verifies the
first candidates, so every call is a verification and MAT = new tokens / target calls (our loops count the
token from the prefill as well and MAT over verification steps; the two agree up to that one token).
"""

from __future__ import annotations

import os
import time
from typing import Iterator

import torch

from .core.attention import stock_attention
from .core.backend import head_rows
from .core.sampling import SamplingParams
from .core.stats import Stats
from .errors import SpecgraftError
from .llama_server import llama_server
from .lossy.rules import parse_rule
from .models import load
from .outputs import Generation, Stream
from .registry import DEFAULTS, check_lossy

_ASSISTANTS: dict[tuple, torch.nn.Module] = {}


def assistant(name: str, dtype: str, vocab_size: int, device: str = "cpu"):
    key = (name, dtype, device)
    if key not in _ASSISTANTS:
        model, _ = load(name, dtype, device=device)
        if head_rows(model) != vocab_size:
            raise SpecgraftError(f"assistant '{name}' does not share the target's vocabulary")
        _ASSISTANTS[key] = model
    return _ASSISTANTS[key]


@torch.inference_mode()
def hf_assisted(engine, ids: list[int], sampling: SamplingParams, max_new_tokens: int, model: str):
    """Greedy or sampled ``generate`` with the assistant; returns ``(token_ids, Stats)``."""
    target = engine.backend.model  # the HF module (the transformers backend declares hf_assisted)
    device = engine.device
    helper = assistant(model, engine.dtype, engine.vocab_size, device)
    calls = []
    hook = target.register_forward_hook(lambda *a: calls.append(1))
    # Override the model's generation_config (Qwen's ships sampling defaults and repetition_penalty=1.1),
    # so that HF runs the same decoding problem as we do.
    kw = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
    if sampling.greedy:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    else:
        # min-p / eta truncation: HF's own warpers (the ones SamplingParams mirrors), so the reference runs
        # the same sampling problem as our methods.
        kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                  top_k=sampling.top_k or None)
        if sampling.min_p:
            kw["min_p"] = sampling.min_p
        if sampling.eta:
            kw["eta_cutoff"] = sampling.eta
    if not sampling.greedy and sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    t0 = time.perf_counter()
    try:
        with stock_attention(target):  # the reference runs stock transformers, not our attention
            out = target.generate(torch.tensor([ids], device=device),
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                  assistant_model=helper, max_new_tokens=max_new_tokens,
                                  eos_token_id=sorted(engine.eos_ids), pad_token_id=sorted(engine.eos_ids)[0],
                                  **kw)
    finally:
        hook.remove()
    stats = Stats(method="hf_assisted")
    stats.total_s = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    stats.new_tokens = len(new)
    steps = max(1, len(calls))  # every call verifies candidates, the first one included
    stats.steps = steps
    # HF does not report per-call acceptance: spread the tokens over the calls (integers summing to len(new)).
    stats.committed = [len(new) // steps + (i < len(new) % steps) for i in range(steps)] if new else []
    return new, stats


_LLAMAS: dict[tuple, object] = {}
LLAMA_PLD_CTX = 2048  # llama_pld's context: prompt + new tokens (its score buffer is this x vocab floats)


def llama_pld(engine, ids: list[int], sampling: SamplingParams, max_new_tokens: int, max_ngram_size: int,
              num_pred_tokens: int):
    """llama-cpp-python's high-level ``Llama`` with its ``LlamaPromptLookupDecoding`` draft, on the engine's GGUF
    (what a llama-cpp-python user would run); returns ``(token_ids, Stats)``. Its KV cache is reset before each
    prompt (no prefix reuse across prompts: our engine prefills every prompt from scratch too). MAT = new tokens
    / decode calls after the prompt's."""
    if "llama_pld" not in engine.capabilities.references:
        raise SpecgraftError("llama_pld is llama-cpp-python's own prompt lookup: run it with --backend llamacpp")
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    be = engine.backend
    key = (str(be.model.path), max_ngram_size, num_pred_tokens)
    if key not in _LLAMAS:
        s = be.settings
        # logits_all=True explicitly: with a draft model Llama computes every position's logits but sizes its
        # score buffer by logits_all as passed (n_batch rows), so prompts past n_batch tokens would fail; the
        # buffer is n_ctx x vocab floats, hence a smaller context than the backend's.
        _LLAMAS[key] = Llama(model_path=str(be.model.path), n_ctx=min(s.n_ctx, LLAMA_PLD_CTX), logits_all=True,
                             n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                             # the backend's threads (llama-cpp-python's default is half the cores for decoding)
                             n_threads=s.n_threads or os.cpu_count(), n_threads_batch=s.n_threads or os.cpu_count(),
                             flash_attn=s.flash_attn != 0,  # the backend's setting (llama.cpp's auto = on, on CPU)
                             draft_model=LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens), verbose=False)
    llm = _LLAMAS[key]
    if len(ids) + max_new_tokens > llm.n_ctx():
        raise SpecgraftError(f"llama_pld: {len(ids)} prompt + {max_new_tokens} new tokens exceed its context of "
                             f"{llm.n_ctx()}")
    calls: list[int] = []
    evaluate = type(llm).eval

    def counted(tokens):
        calls.append(len(tokens))
        return evaluate(llm, tokens)

    llm.eval = counted
    llm.reset()
    # the same processing as ours: llama-cpp-python's defaults (min_p 0.05, top_k 40, ...) switched off
    kw = {"temp": 0.0} if sampling.greedy else {
        "temp": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or 0,
        "min_p": sampling.min_p, "typical_p": 1.0, "repeat_penalty": 1.0}
    if not sampling.greedy and sampling.eta:
        raise SpecgraftError("llama_pld: llama-cpp-python has no eta sampling")
    if not sampling.greedy and sampling.seed is not None:
        llm.set_seed(sampling.seed)
    t0 = time.perf_counter()
    new: list[int] = []
    try:
        for tok in llm.generate(ids, reset=True, **kw):
            new.append(int(tok))
            if tok in engine.eos_ids or len(new) >= max_new_tokens:
                break
    finally:
        del llm.eval
    stats = Stats(method="llama_pld")
    stats.total_s = time.perf_counter() - t0
    stats.new_tokens = len(new)
    prompt_calls = -(-len(ids) // llm.n_batch)
    steps = max(1, len(calls) - prompt_calls)
    stats.steps = steps
    stats.committed = [len(new) // steps + (i < len(new) % steps) for i in range(steps)] if new else []
    return new, stats


def reference_stream(engine, method, prompt, sampling, max_new_tokens, stop, chat, verify, options) -> Stream:
    """A library's own speculative loop (transformers' assisted generation, llama-cpp-python's prompt lookup) as
    an engine stream: an outside reference, not a drafter of the engine's loop."""
    rule = parse_rule(verify)
    if rule.lossy:
        check_lossy(rule, method, options, sampling)
    if stop:
        raise SpecgraftError(f"{method} does not support stop strings")
    engine.drafter(method, **options)  # checks the options and the backend
    opts = {**DEFAULTS[method], **options}
    ids = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else \
        engine.encode(prompt, chat)
    config = engine._config(method, options, 0, sampling, max_new_tokens, chat, stop, rule, None)
    stream = Stream(iter(()))

    def pieces() -> Iterator[str]:
        if method == "hf_assisted":
            out, stats = hf_assisted(engine, ids, sampling, max_new_tokens, opts["model"])
        elif method == "llama_server":
            out, stats = llama_server(engine, ids, sampling, max_new_tokens, opts["spec"], opts["draft_model"],
                                      opts["args"])
        else:
            out, stats = llama_pld(engine, ids, sampling, max_new_tokens, opts["max_ngram_size"],
                                   opts["num_pred_tokens"])
        text = engine.tokenizer.decode(out, skip_special_tokens=True)
        yield text
        stream.result = Generation(text, out, ids, stats, {**config, "drafter": {"method": method}},
                                   "eos" if out and out[-1] in engine.eos_ids else "length")

    stream._pieces = pieces()
    return stream
