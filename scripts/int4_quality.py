"""How close ``--dtype int4`` (the GGUF's own 4-bit codes, bf16 activations) and bf16 are to the dequantised GGUF
in fp32 (docs/benchmarks.md, "CPU step"):

    python scripts/int4_quality.py --model qwen2.5-coder-1.5b --out docs/data/int4-quality-qwen15.json

- per linear layer: max |weight - fp32 weight| / max |fp32 weight| (int4 layers; the bf16 copy for comparison);
- greedy agreement: on the fp32 exactness prompts (tests/test_smollm2.py), the fp32 model's greedy continuation is
  fed to each model; the first position whose argmax differs is where that model's own greedy output would leave
  fp32's, and the share of matching argmaxes is reported too;
- perplexity on held-out text (ShareGPT answers from offset 4000 of the shared file: never a benchmark prompt).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from specgraft import models
from specgraft.backends import int4
from specgraft.eval.datasets import load_conversations
from tests.test_smollm2 import PROMPTS


def fp32_continuations(model, tok, n_new: int) -> list[tuple[list[int], list[int]]]:
    out = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        gen = model.generate(ids, max_new_tokens=n_new, do_sample=False)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
        print(f"fp32 continuation {len(out)}/{len(PROMPTS)}", file=sys.stderr, flush=True)
    return out


def agreement(model, pairs) -> dict:
    """Teacher-forced on fp32's continuations: argmax agreement share and the first divergence per prompt."""
    firsts, same, total = [], 0, 0
    for prompt, cont in pairs:
        ids = torch.tensor([prompt + cont])
        pred = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().argmax(-1)
        hit = pred == torch.tensor(cont)
        same, total = same + int(hit.sum()), total + len(cont)
        firsts.append(len(cont) if bool(hit.all()) else int((~hit).nonzero()[0]))
    return {"argmax_agreement": round(same / total, 4), "first_divergence": firsts,
            "identical_prompts": sum(f == len(pairs[0][1]) for f in firsts)}


def perplexity(model, ids: list[int], window: int) -> float:
    return perplexity_of(lambda x: model(input_ids=x.unsqueeze(0)).logits[0], ids, window)


def perplexity_of(logits_of, ids: list[int], window: int) -> float:
    """Perplexity of ``ids`` in windows; ``logits_of(ids: [T]) -> [T, V]`` (any backend)."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor(ids[start:start + window + 1])
        logits = logits_of(chunk[:-1]).float()
        nll += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += len(chunk) - 1
    return math.exp(nll / count)


def quality_args() -> argparse.Namespace:
    """The options both quality scripts take."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--ppl-tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out")
    return p.parse_args()


def held_out_text(tok, n_tokens: int) -> list[int]:
    ids: list[int] = []
    for _, messages in load_conversations()[4000:]:
        for m in messages:
            if m["role"] == "assistant":
                ids += tok(m["content"]).input_ids
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    return ids


def layer_errors(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], names) -> dict:
    return {n: float((weights[f"{n}.weight"].float() - reference[f"{n}.weight"]).abs().max()
                     / reference[f"{n}.weight"].abs().max()) for n in names}


@torch.inference_mode()
def main() -> None:
    args = quality_args()
    fp32, tok = models.load(args.model, "float32")
    reference = fp32.state_dict()
    pairs = fp32_continuations(fp32, tok, args.new_tokens)
    text = held_out_text(tok, args.ppl_tokens)
    result = {"model": args.model, "prompts": len(PROMPTS), "new_tokens": args.new_tokens,
              "ppl_tokens": len(text), "window": args.window, "models": {}}
    t = time.time()
    result["models"]["float32"] = {"perplexity": round(perplexity(fp32, text, args.window), 4)}
    print(f"fp32 perplexity {result['models']['float32']['perplexity']} ({time.time() - t:.0f} s)", file=sys.stderr)
    del fp32
    bf16, _ = models.load(args.model, "bfloat16")
    q4, _ = models.load(args.model, "bfloat16")
    report = int4.convert(q4, models.gguf_file(args.model)[0], reference)
    bf16_err = layer_errors(bf16.state_dict(), reference, report.int4)
    for name, model in (("bfloat16", bf16), ("int4", q4)):
        row = agreement(model, pairs)
        row["perplexity"] = round(perplexity(model, text, args.window), 4)
        result["models"][name] = row
        print(name, row, file=sys.stderr, flush=True)
    rel = {n: e / top for n, (e, top) in report.int4.items()}
    result["int4_layers"], result["bf16_layers"] = len(report.int4), report.bf16
    result["max_rel_weight_error"] = {"int4": round(max(rel.values()), 5), "bfloat16": round(max(bf16_err.values()), 5),
                                      "int4_median": round(sorted(rel.values())[len(rel) // 2], 5)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
