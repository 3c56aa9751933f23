"""How far ``--dtype gguf-q8`` (the GGUF with its tensors that lack a batched llama.cpp kernel re-quantised to Q8_0)
is from the user's original file, both on llama.cpp (docs/backends.md, "gguf-q8"):

    PYTHONPATH=. python scripts/gguf_variant_quality.py --model qwen2.5-coder-1.5b --out docs/data/gguf-q8-quality-qwen15.json

- greedy agreement: the original's greedy continuations (llama.cpp AR) of the exactness prompts
  (tests/test_smollm2.py) are fed to the variant; the share of matching argmaxes and the first position where
  the variant's own greedy output would leave the original's;
- perplexity of both on held-out text (ShareGPT answers from offset 4000: never a benchmark prompt).
"""

from __future__ import annotations

import json
import sys

import torch

from scripts.int4_quality import held_out_text, perplexity_of, quality_args
from specgraft.backends import llamacpp_backend
from tests.test_smollm2 import PROMPTS


def perplexity(be, ids: list[int], window: int) -> float:
    return perplexity_of(lambda x: be.prefill(x, all_logits=True).logits, ids, window)


def main() -> None:
    args = quality_args()
    from specgraft import Engine
    from transformers import AutoTokenizer

    engine = Engine(args.model, backend="llamacpp")
    original = engine.backend
    variant, tok_dir = llamacpp_backend(args.model, weights="gguf-q8")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    same, total, firsts, identical = 0, 0, [], 0
    for prompt in PROMPTS:
        g = engine.generate(prompt, "ar", max_new_tokens=args.new_tokens)
        ids, cont = g.prompt_ids, g.token_ids
        logits = variant.prefill(torch.tensor(ids + cont[:-1]), all_logits=True).logits[len(ids) - 1:]
        hit = logits.argmax(-1) == torch.tensor(cont)
        same, total = same + int(hit.sum()), total + len(cont)
        firsts.append(len(cont) if bool(hit.all()) else int((~hit).nonzero()[0]))
        identical += bool(hit.all())
        print(f"prompt {len(firsts)}/{len(PROMPTS)}: first divergence {firsts[-1]}", file=sys.stderr, flush=True)
    text = held_out_text(tok, args.ppl_tokens)
    result = {"model": args.model, "files": {"gguf": str(original.model.path), "gguf-q8": str(variant.model.path)},
              "prompts": len(PROMPTS), "new_tokens": args.new_tokens, "argmax_agreement": round(same / total, 4),
              "first_divergence": firsts, "identical_prompts": identical,
              "ppl_tokens": len(text), "window": args.window,
              "perplexity": {"gguf": round(perplexity(original, text, args.window), 4),
                             "gguf-q8": round(perplexity(variant, text, args.window), 4)}}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
