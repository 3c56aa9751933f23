"""``specgraft train-head``: train an EAGLE-3 head on cached target features, resumably.

One optimizer step = several conversations (``batch_tokens``); the state (head, AdamW, schedule, epoch,
position in the epoch, metrics) is checkpointed atomically every ``ckpt_every`` steps, and ``--resume``
continues from it. Held-out per-step accuracy is measured every ``eval_every`` steps and at the end;
``metrics.jsonl`` and ``training.png`` show loss and accuracy against tokens seen and wall time. The result
is exported in the official EAGLE-3 format (:func:`specgraft.eagle.checkpoint.save_head`).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ...errors import SpecgraftError
from ..head import Eagle3Head, parameter_count
from ..checkpoint import config_for_target, save_head
from .features import load_shard
from .ttt import ttt_loss


@dataclass
class TrainConfig:
    draft_vocab: int = 8192
    intermediate: int = 2048
    ttt_steps: int = 3
    epochs: float = 2.0
    lr: float = 5e-4
    batch_tokens: int = 4096
    warmup_steps: int = 20
    eval_every: int = 50
    ckpt_every: int = 25
    seed: int = 0
    device: str = "auto"


def choose_vocab(shards: list[Path], vocab_size: int, size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` target ids most often predicted (target top-1 at labelled positions); coverage."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for shard in shards:
        for conv in load_shard(shard):
            lab = conv["topk_p"][:, 0] > 0
            counts += torch.bincount(conv["topk_ids"][lab, 0].long(), minlength=vocab_size)
    size = min(size, vocab_size)
    top = torch.topk(counts, size).indices.sort().values
    return top, float(counts[top].sum() / max(1, counts.sum()))


def init_head(target, vocab_ids: torch.Tensor, intermediate: int) -> Eagle3Head:
    """Random layer; embedding (frozen), final norm and ``lm_head`` rows copied from the target (faster start)."""
    head = Eagle3Head(config_for_target(target.config, len(vocab_ids), intermediate),
                      target.get_input_embeddings().weight.detach().float())
    head.set_vocab(vocab_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight.detach().float()[vocab_ids])
        head.norm.weight.copy_(target.base_model.norm.weight.detach().float())
    return head


def evaluate(head: Eagle3Head, convs: list[dict], steps: int, t2d_index: torch.Tensor, autocast) -> dict:
    head.eval()
    correct, count, loss = [0] * steps, [0] * steps, [0.0] * steps
    with torch.no_grad(), autocast():
        for conv in convs:
            _, per = ttt_loss(head, conv, steps, t2d_index)
            for i, (c, k, l) in enumerate(per):
                correct[i], count[i], loss[i] = correct[i] + c, count[i] + k, loss[i] + l
    head.train()
    return {"eval_acc": [c / max(1, k) for c, k in zip(correct, count)],
            "eval_loss": [l / max(1, k) for l, k in zip(loss, count)], "eval_positions": count[0]}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _move(conv: dict, device) -> dict:
    return {k: v.to(device) for k, v in conv.items()}


class _Run:
    """One training run between its set-up and its export: the head and its optimizer, the progress a checkpoint
    saves (so ``--resume`` continues at the same step and conversation), and the held-out set every evaluation
    uses."""

    def __init__(self, target, features_dir: Path, out_dir: Path, cfg: TrainConfig, resume: bool, log):
        self.meta = json.loads((features_dir / "features.json").read_text())
        self.shards = [features_dir / s for s in self.meta["shards"]]
        self.state_dir = out_dir / "train_state"
        self.ckpt_path = self.state_dir / "checkpoint.pt"
        if self.ckpt_path.exists() and not resume:
            raise SpecgraftError(f"{out_dir} already holds a training run; pass --resume to continue it or pick a "
                                 "new --out")
        if resume and not self.ckpt_path.exists():
            raise SpecgraftError(f"nothing to resume in {out_dir} (no train_state/checkpoint.pt)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.device = _device(cfg.device)
        ckpt = None
        if resume:  # the run's own configuration wins over the flags, except where it runs
            ckpt = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
            cfg = TrainConfig(**{**ckpt["config"], "device": cfg.device})
            self.vocab_ids, self.coverage = ckpt["vocab_ids"], ckpt["coverage"]
        else:
            self.vocab_ids, self.coverage = choose_vocab(self.shards, target.config.vocab_size, cfg.draft_vocab)
            log(f"draft vocabulary: {len(self.vocab_ids)} tokens cover {self.coverage:.1%} of the target's "
                "labelled predictions")
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.head = init_head(target, self.vocab_ids, cfg.intermediate).to(self.device).train()
        t2d_index = torch.full((target.config.vocab_size,), -1, dtype=torch.long)  # target id -> draft id (or -1)
        t2d_index[self.vocab_ids] = torch.arange(len(self.vocab_ids))
        self.t2d_index = t2d_index.to(self.device)
        self.params = [p for n, p in self.head.named_parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.train_tokens = self.meta["train_tokens"]
        self.total_steps = max(1, math.ceil(self.train_tokens * cfg.epochs / cfg.batch_tokens))
        self.prog = {"step": 0, "epoch": 0, "conv_in_epoch": 0, "tokens_seen": 0, "wall_s": 0.0}
        if ckpt is not None:
            self.head.load_state_dict(ckpt["head"])
            self.opt.load_state_dict(ckpt["opt"])
            self.prog = ckpt["progress"]
            log(f"resuming at step {self.prog['step']} (epoch {self.prog['epoch']}, {self.prog['tokens_seen']} "
                "tokens seen)")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16))
        self.eval_convs = [_move(c, self.device) for c in load_shard(features_dir / "eval.safetensors")]
        self.metrics_path = out_dir / "metrics.jsonl"
        self.n_params = parameter_count(self.head)
        # the train loss averaged since the last record, and when the current stretch of training time began
        self.loss_sum, self.loss_n, self.t_mark = 0.0, 0, time.perf_counter()

    def lr_at(self, step: int) -> float:  # linear warm-up, cosine to 10%
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        x = min(1.0, (step - cfg.warmup_steps) / max(1, self.total_steps - cfg.warmup_steps))
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x)))

    def evaluate(self) -> dict:
        return evaluate(self.head, self.eval_convs, self.cfg.ttt_steps, self.t2d_index, self.autocast)

    def checkpoint(self) -> None:
        """Written to a temporary file and renamed: a run killed mid-save keeps its previous checkpoint."""
        tmp = self.state_dir / "checkpoint.pt.tmp"
        torch.save({"config": asdict(self.cfg), "vocab_ids": self.vocab_ids, "coverage": self.coverage,
                    "head": self.head.state_dict(), "opt": self.opt.state_dict(), "progress": self.prog}, tmp)
        os.replace(tmp, self.ckpt_path)

    def record(self, extra: dict) -> None:
        prog = self.prog
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({**prog, **extra}) + "\n")
        acc = " ".join(f"{a:.3f}" for a in extra.get("eval_acc", []))
        self.log(f"step {prog['step']}/{self.total_steps} tokens {prog['tokens_seen']} wall {prog['wall_s']:.0f}s "
                 f"train_loss {extra.get('train_loss', float('nan')):.3f} held-out top-1 per step: {acc}")

    def train_epoch(self, bar) -> bool:
        """One pass over the shards in this epoch's order, skipping the conversations a resumed run already
        trained on; True if the pass completed, False if it stopped at the last step."""
        prog, cfg = self.prog, self.cfg
        order = list(range(len(self.shards)))
        random.Random(cfg.seed + prog["epoch"]).shuffle(order)
        convs_done = 0
        batch_tok = 0
        for si in order:
            convs = load_shard(self.shards[si])
            if convs_done + len(convs) <= prog["conv_in_epoch"]:
                convs_done += len(convs)  # already trained on in this epoch before the resume
                continue
            for conv in convs:
                convs_done += 1
                if convs_done <= prog["conv_in_epoch"]:
                    continue
                with self.autocast():
                    loss, per = ttt_loss(self.head, _move(conv, self.device), cfg.ttt_steps, self.t2d_index)
                if loss is None or not torch.is_tensor(loss):
                    continue
                tokens = int(conv["ids"].shape[0])
                # gradients accumulate over whole conversations, each weighted by its share of the batch
                (loss * tokens / cfg.batch_tokens).backward()
                self.loss_sum, self.loss_n = self.loss_sum + float(loss.detach()), self.loss_n + 1
                batch_tok += tokens
                prog["tokens_seen"] += tokens
                prog["conv_in_epoch"] = convs_done
                if batch_tok < cfg.batch_tokens:
                    continue
                batch_tok = 0
                if self.optimizer_step(bar):
                    return False
        return True

    def optimizer_step(self, bar) -> bool:
        """Apply the accumulated batch, then evaluate and checkpoint when due; True after the last step."""
        prog, cfg = self.prog, self.cfg
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(prog["step"])
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        prog["step"] += 1
        now = time.perf_counter()
        prog["wall_s"] += now - self.t_mark
        self.t_mark = now
        bar.update(1)
        bar.set_postfix(loss=f"{self.loss_sum / max(1, self.loss_n):.3f}", epoch=prog["epoch"])
        last = prog["step"] >= self.total_steps
        if prog["step"] % cfg.eval_every == 0 or last:
            self.record({"train_loss": self.loss_sum / max(1, self.loss_n), **self.evaluate()})
            self.loss_sum, self.loss_n = 0.0, 0
            self.t_mark = time.perf_counter()  # evaluation time is not training time
        if prog["step"] % cfg.ckpt_every == 0 or last:
            self.checkpoint()
        return last

    def export(self, target, out_dir: Path, target_name: str | None) -> dict:
        """Final checkpoint and evaluation; the head in EAGLE-3 format, its summary, model card and plot."""
        self.checkpoint()
        final = self.evaluate()
        summary = {"target": target_name or target.config._name_or_path or target.config.model_type,
                   "config": asdict(self.cfg), "parameters": self.n_params, "draft_vocab_coverage": self.coverage,
                   "unique_train_tokens": self.train_tokens, "feature_seconds": self.meta["seconds"],
                   "device": str(self.device), **self.prog, **final}
        save_head(self.head.cpu().float(), out_dir, extra={"specgraft_training": {
            k: summary[k] for k in ("tokens_seen", "step", "wall_s", "unique_train_tokens", "eval_acc")}})
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out_dir / "README.md").write_text(model_card(summary, self.meta))
        plot(self.metrics_path, out_dir / "training.png")
        return summary


def train(target, features_dir: Path, out_dir: Path, cfg: TrainConfig, resume: bool = False,
          log=print, target_name: str | None = None) -> dict:
    run = _Run(target, features_dir, out_dir, cfg, resume, log)
    if run.prog["step"] == 0:  # the untrained head: where the curves start
        run.record({"train_loss": float("nan"), **run.evaluate()})
    bar = tqdm(total=run.total_steps, initial=run.prog["step"], unit="step", desc="train-head", dynamic_ncols=True)
    run.t_mark = time.perf_counter()  # set-up and the first evaluation are not training time
    while run.prog["step"] < run.total_steps:
        if run.train_epoch(bar):
            run.prog["epoch"] += 1
            run.prog["conv_in_epoch"] = 0
    bar.close()
    return run.export(target, out_dir, target_name)


def model_card(s: dict, meta: dict) -> str:
    acc = " / ".join(f"{a:.3f}" for a in s["eval_acc"])
    c = s["config"]
    return f"""# EAGLE-3 head for {s['target']}

Trained with `specgraft train-head` (official EAGLE-3 / SpecForge checkpoint format, bf16 safetensors).

| | |
|---|---|
| target features | hidden states entering layers {meta['layers']} (bf16 target) |
| data | ShareGPT conversations rendered with the target's chat template, loss on assistant tokens only, \
labels = the target's own top-{meta['top_k']} next-token probabilities; {meta['eval_convs']} conversations held out |
| unique training tokens | {s['unique_train_tokens']:,} (max {meta['max_len']} per conversation) |
| tokens seen | {s['tokens_seen']:,} ({s['tokens_seen'] / s['unique_train_tokens']:.1f} passes), {s['step']} optimizer steps of \
>= {c['batch_tokens']} tokens (whole conversations) |
| head | 1 layer, MLP width {c['intermediate']}, draft vocabulary {c['draft_vocab']} \
({s['draft_vocab_coverage']:.1%} of the target's predictions), {s['parameters'] / 1e6:.1f}M trainable parameters |
| training | TTT unroll {c['ttt_steps']} steps (weights 0.8^i), AdamW lr {c['lr']}, cosine; \
{s['wall_s'] / 60:.1f} min of training + {s['feature_seconds'] / 60:.1f} min of target features on {s.get('device', 'CPU')} |
| held-out top-1 agreement per TTT step | {acc} |

Measured acceptance in decoding: see `docs/benchmarks.md` (MAT per tree budget, acceptance per depth).
"""


def plot(metrics_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
    tok = [r["tokens_seen"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([r["tokens_seen"] for r in rows if r["train_loss"] == r["train_loss"]],
           [r["train_loss"] for r in rows if r["train_loss"] == r["train_loss"]], label="train (weighted TTT)")
    a.plot(tok, [r["eval_loss"][0] for r in rows], label="held-out, step 1")
    a.set_xlabel("tokens seen")
    a.set_ylabel("soft cross-entropy")
    a.legend()
    for i in range(len(rows[0]["eval_acc"])):
        b.plot(tok, [r["eval_acc"][i] for r in rows], marker=".", label=f"step {i + 1}")
    b.set_xlabel("tokens seen")
    b.set_ylabel("held-out top-1 agreement with the target")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
