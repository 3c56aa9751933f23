"""Target features for head training, computed once and cached in resumable shards.

For every conversation (rendered with the target's chat template, cut at ``max_len`` tokens) one bf16
forward of the target gives, per position ``t``:

- ``feats[t]``: the hidden states entering layers ``2, L//2, L-3`` concatenated, ``[3H]`` (EAGLE-3 inputs);
- ``topk_ids[t], topk_p[t]``: the target's top-``K`` next-token probabilities (soft labels, temperature 1);
- ``mask[t]``: 1 where token ``t`` belongs to an assistant turn (only those are predicted in training).

Caching costs ``3H * 2 + K * 6`` bytes per token (about 9.3 KB for the 1.5B) and lets training run several
epochs and resume without paying the target again; the target forward dominates the cost (measured in the
model card). Shards are written atomically; ``features.json`` records how many conversations are done.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ...errors import SpecgraftError
from ..checkpoint import default_layers

TOP_K = 8


def render(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of a chat-templated conversation and its assistant mask (content plus the end-of-turn token)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc.input_ids[:max_len], enc.offset_mapping[:max_len]
    spans, cursor = [], 0
    for m in messages:
        at = text.find(m["content"], cursor)
        if at < 0:
            continue
        cursor = at + len(m["content"])
        if m["role"] == "assistant":
            spans.append((at, cursor))
    mask = [0] * len(ids)
    for a, b in spans:
        inside = [i for i, (s, _) in enumerate(offsets) if a <= s < b]
        if inside:
            last = inside[-1] + 1  # the token closing the turn (e.g. <|im_end|>) is predicted too
            for i in range(inside[0], min(last + 1, len(ids))):
                mask[i] = 1
    return ids, mask


@torch.inference_mode()
def target_features(model, ids: list[int], mask: list[int], layers: tuple[int, ...],
                    top_k: int = TOP_K) -> dict[str, torch.Tensor]:
    """Features at every position; soft labels only where the next token is an assistant token (the
    only labels training reads), which skips most of the lm_head and softmax over a 150k vocabulary."""
    out = model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i][0] for i in layers], -1).to(torch.bfloat16)
    want = torch.tensor(mask[1:] + [0], dtype=torch.bool)
    logits = model.get_output_embeddings()(out.last_hidden_state[0, want])
    p, tid = torch.topk(torch.softmax(logits.float(), -1), top_k, -1)
    topk_p = torch.zeros(len(ids), top_k, dtype=torch.float16)
    topk_ids = torch.zeros(len(ids), top_k, dtype=torch.int32)
    topk_p[want], topk_ids[want] = p.to(torch.float16), tid.to(torch.int32)
    return {"feats": feats, "topk_ids": topk_ids, "topk_p": topk_p}


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _pack(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "feats": torch.cat([r["feats"] for r in rows]),
        "topk_ids": torch.cat([r["topk_ids"] for r in rows]),
        "topk_p": torch.cat([r["topk_p"] for r in rows]),
        "ids": torch.cat([torch.tensor(r["ids"], dtype=torch.int32) for r in rows]),
        "mask": torch.cat([torch.tensor(r["mask"], dtype=torch.uint8) for r in rows]),
        "lengths": torch.tensor([len(r["ids"]) for r in rows], dtype=torch.int32),
    }


def conversation_order(convs: list, seed: int = 0) -> list:
    order = list(convs)
    random.Random(seed).shuffle(order)
    return order


def extract(model, tokenizer, convs: list[tuple[str, list[dict]]], out_dir: Path, max_tokens: int,
            max_len: int = 1024, eval_convs: int = 24, shard_tokens: int = 32768, seed: int = 0) -> dict:
    """Write ``eval.safetensors`` (the first ``eval_convs`` conversations, held out) and ``train-NNNNN``
    shards until ``max_tokens`` training tokens are cached. Resumes from ``features.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = default_layers(model.config.num_hidden_layers)
    meta_path = out_dir / "features.json"
    meta = {"layers": list(layers), "hidden_size": model.config.hidden_size, "max_len": max_len, "seed": seed,
            "top_k": TOP_K, "eval_convs": eval_convs, "done_convs": 0, "train_tokens": 0, "shards": [],
            "eval_tokens": 0, "seconds": 0.0}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        for key in ("layers", "hidden_size", "max_len", "seed", "eval_convs"):
            if old[key] != meta[key]:
                raise SpecgraftError(f"{out_dir}: cached features were made with {key}={old[key]}, not {meta[key]}; "
                                     "use another --features directory")
        meta = old
    order = conversation_order(convs, seed)
    bar = tqdm(total=max_tokens, initial=min(meta["train_tokens"], max_tokens), unit="tok", desc="features",
               dynamic_ncols=True)
    rows: list[dict] = []
    pending_tokens, t_start, i = 0, time.perf_counter(), meta["done_convs"]
    while i < len(order) and meta["train_tokens"] < max_tokens:
        _, messages = order[i]
        ids, mask = render(tokenizer, messages, max_len)
        i += 1
        in_eval = i <= meta["eval_convs"]
        if sum(mask) >= 8:  # too little assistant text to learn from
            rows.append({"ids": ids, "mask": mask, **target_features(model, ids, mask, layers)})
            pending_tokens += len(ids)
            if not in_eval:
                bar.update(len(ids))
        if in_eval and i == meta["eval_convs"] and rows:
            _save_atomic(_pack(rows), out_dir / "eval.safetensors")
            meta["eval_tokens"] = pending_tokens
        elif in_eval or not rows or (pending_tokens < shard_tokens
                                     and meta["train_tokens"] + pending_tokens < max_tokens):
            continue
        else:
            name = f"train-{len(meta['shards']):05d}.safetensors"
            _save_atomic(_pack(rows), out_dir / name)
            meta["shards"].append(name)
            meta["train_tokens"] += pending_tokens
        meta["done_convs"] = i
        meta["seconds"] += time.perf_counter() - t_start
        t_start = time.perf_counter()
        meta_path.write_text(json.dumps(meta, indent=1))
        rows, pending_tokens = [], 0
    bar.close()
    if not meta["shards"]:
        raise SpecgraftError("no training features were produced (too little data?)")
    return meta


def load_shard(path: Path) -> list[dict[str, torch.Tensor]]:
    """A shard as a list of conversations (views into the shard's tensors)."""
    t = load_file(str(path))
    out, start = [], 0
    for n in t["lengths"].tolist():
        out.append({k: t[k][start : start + n] for k in ("feats", "topk_ids", "topk_p", "ids", "mask")})
        start += n
    return out
