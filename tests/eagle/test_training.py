"""Head training on a tiny target: assistant masks, feature cache resume, TTT training that learns, resume."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from specgraft import models
from specgraft.core.backend import TargetBackend
from specgraft.registry import make_drafter
from specgraft.errors import SpecgraftError
from specgraft.eagle.checkpoint import load_head
from specgraft.core.sampling import SamplingParams
from specgraft.eagle.training.features import extract, load_shard, render
from specgraft.eagle.training.trainer import TrainConfig, train

from ..conftest import tiny_llama
from ..engine.test_engine import run


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(models.resolve("smollm2-135m"))


def conversations(n: int) -> list:
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    out = []
    for i in range(n):
        q = " ".join(words[(i + j) % 6] for j in range(5))
        a = " ".join(words[(i * 7 + j * 3) % 6] for j in range(30))
        out.append((str(i), [{"role": "user", "content": f"Question {i}: {q}?"},
                             {"role": "assistant", "content": f"Answer: {a}."},
                             {"role": "user", "content": "More please."},
                             {"role": "assistant", "content": f"Sure. {a} {a}."}]))
    return out


def test_render_masks_assistant_turns_only(tok):
    _, msgs = conversations(1)[0]
    ids, mask = render(tok, msgs, 1024)
    masked = tok.decode([t for t, m in zip(ids, mask) if m])
    assert "Answer:" in masked and "Sure." in masked
    assert "Question" not in masked and "More please" not in masked
    ids2, mask2 = render(tok, msgs, 20)
    assert len(ids2) == 20 and mask2 == mask[:20]


def test_feature_cache_resumes_and_extends(tmp_path, tok):
    target = tiny_llama(vocab=len(tok), layers=4)
    convs = conversations(40)
    meta = extract(target, tok, convs, tmp_path, max_tokens=600, eval_convs=3, shard_tokens=300)
    assert meta["train_tokens"] >= 600 and (tmp_path / "eval.safetensors").exists()
    shards = list(meta["shards"])
    again = extract(target, tok, convs, tmp_path, max_tokens=600, eval_convs=3, shard_tokens=300)
    assert again["shards"] == shards  # nothing recomputed
    more = extract(target, tok, convs, tmp_path, max_tokens=1500, eval_convs=3, shard_tokens=300)
    assert more["shards"][: len(shards)] == shards and more["train_tokens"] >= 1500
    conv = load_shard(tmp_path / shards[0])[0]
    assert conv["feats"].shape == (conv["ids"].shape[0], 3 * 32)
    labelled = conv["topk_p"][:, 0] > 0
    assert torch.equal(labelled[:-1], conv["mask"][1:].bool())  # labels exactly where the next token is assistant's
    with pytest.raises(SpecgraftError, match="max_len=1024, not 512"):
        extract(target, tok, convs, tmp_path, max_tokens=600, max_len=512, eval_convs=3)


def test_training_learns_resumes_and_exports(tmp_path, tok):
    target = tiny_llama(vocab=len(tok), layers=4, scale=8.0)
    with torch.no_grad():  # a target with a small effective vocabulary, so the head can learn it quickly
        target.lm_head.weight[400:] = 0
    convs = conversations(60)
    feats = tmp_path / "features"
    extract(target, tok, convs, feats, max_tokens=4000, eval_convs=4, shard_tokens=1000)
    cfg = TrainConfig(draft_vocab=256, intermediate=64, ttt_steps=2, epochs=6, lr=3e-3, batch_tokens=600,
                      warmup_steps=2, eval_every=10, ckpt_every=5)
    logs = []
    first = train(target, feats, tmp_path / "head", cfg, log=logs.append)
    rows = [json.loads(l) for l in (tmp_path / "head" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_acc"][0] > rows[0]["eval_acc"][0] + 0.2  # it learns the target's predictions
    assert (tmp_path / "head" / "training.png").stat().st_size > 1000
    with pytest.raises(SpecgraftError, match="--resume"):
        train(target, feats, tmp_path / "head", cfg)
    # Resume from a mid-run checkpoint: continue to the same number of steps.
    ckpt = torch.load(tmp_path / "head" / "train_state" / "checkpoint.pt", weights_only=False)
    ckpt["progress"]["step"] = 10
    torch.save(ckpt, tmp_path / "head" / "train_state" / "checkpoint.pt")
    resumed = train(target, feats, tmp_path / "head", cfg, resume=True, log=logs.append)
    assert any("resuming at step 10" in m for m in logs)
    assert resumed["step"] == first["step"]
    head = load_head(tmp_path / "head", target)
    backend = TargetBackend(target)
    prompt = tok.apply_chat_template(convs[50][1][:1], add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    ref, _ = run(backend, make_drafter("ar", len(tok)), prompt, SamplingParams(), 30, 0)
    drafter = make_drafter("eagle", len(tok), target=target, head=head, top_k=4, depth=4)
    out, st = run(backend, drafter, prompt, SamplingParams(), 30, 15)
    assert out == ref
    assert st.new_tokens / st.steps > 1.3  # the trained head is accepted, unlike a random one
