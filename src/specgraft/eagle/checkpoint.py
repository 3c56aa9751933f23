"""EAGLE-3 head checkpoints in the official / SpecForge format, and matching a head to its target.

A checkpoint directory holds ``config.json`` (a Llama config with ``num_hidden_layers: 1`` and
``draft_vocab_size``; ``architectures`` is ``LlamaForCausalLM`` in EAGLE's files, ``LlamaForCausalLMEagle3``
in SpecForge's) and ``model.safetensors`` or ``pytorch_model.bin`` with ``fc``, ``midlayer.*``, ``norm``,
``lm_head``, ``d2t``, ``t2d`` and sometimes ``embed_tokens``. We read both layouts and write the first.
Which target layers feed the head is stored as ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the
``hidden_states`` indices); when absent, EAGLE-3's ``(2, L//2, L-3)`` is assumed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import SpecgraftError
from .head import Eagle3Head, HeadConfig

ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle3")
REQUIRED = ("fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight")


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """``hidden_states`` indices of the low / middle / high features (entry ``i`` is the input to layer ``i``):
    what heads read by default, and what ``train-head`` caches."""
    return (2, num_layers // 2, num_layers - 3)


def config_for_target(target_config, draft_vocab_size: int, intermediate_size: int) -> HeadConfig:
    """A head shaped like the target's layers (heads, head_dim, rope) with our own MLP width and vocab."""
    tc = target_config
    rope_theta = getattr(tc, "rope_theta", None) or (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1e4)
    return HeadConfig(
        hidden_size=tc.hidden_size, intermediate_size=intermediate_size,
        num_attention_heads=tc.num_attention_heads, num_key_value_heads=tc.num_key_value_heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size, rms_norm_eps=tc.rms_norm_eps,
        rope_theta=float(rope_theta), max_position_embeddings=tc.max_position_embeddings,
        target_layers=default_layers(tc.num_hidden_layers))


def save_head(head: Eagle3Head, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
              extra: dict | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (without the target's embedding), atomically per file."""
    c, out = head.config, Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.target_layers)},
        **(extra or {}),
    }
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
             for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json.tmp").write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(out / "config.json.tmp", out / "config.json")
    return out


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").exists():
        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise SpecgraftError(f"head '{path}' has neither model.safetensors nor pytorch_model.bin")


def read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise SpecgraftError(f"head '{path}' has no config.json") from None
    except json.JSONDecodeError as err:
        raise SpecgraftError(f"head '{path}': config.json is not valid JSON ({err.msg})") from None
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise SpecgraftError(f"head '{path}': architecture {arch!r} is not an EAGLE-3 head ({', '.join(ARCHITECTURES)})")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise SpecgraftError(f"head '{path}' has {cfg['num_hidden_layers']} layers; EAGLE-3 heads have exactly 1")
    return cfg


def load_head(path: str | os.PathLike, target, dtype: torch.dtype | None = None) -> Eagle3Head:
    """Load a head for ``target`` (an HF causal LM), refusing one that does not match it."""
    path = Path(path)
    if not path.is_dir():
        raise SpecgraftError(f"head '{path}' not found (expected a directory with config.json)")
    cfg, tc = read_config(path), target.config
    for key, want in (("hidden_size", tc.hidden_size), ("vocab_size", tc.vocab_size)):
        if cfg.get(key) != want:
            raise SpecgraftError(f"head '{path}' does not match the target: {key} is {cfg.get(key)} in the head, "
                                 f"{want} in the target ({tc.model_type})")
    layers = tuple((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                   or default_layers(tc.num_hidden_layers))
    if len(layers) != 3 or max(layers) > tc.num_hidden_layers:
        raise SpecgraftError(f"head '{path}' reads target layers {list(layers)}, but the target has "
                             f"{tc.num_hidden_layers} layers")
    state = _read_state(path)
    missing = [k for k in REQUIRED if k not in state]
    if missing:
        raise SpecgraftError(f"head '{path}' lacks weights {missing}")
    n_heads = cfg["num_attention_heads"]
    c = HeadConfig(
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_attention_heads=n_heads,
        num_key_value_heads=cfg.get("num_key_value_heads", n_heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads, vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"], rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768), target_layers=layers)
    if state["fc.weight"].shape != (c.hidden_size, 3 * c.hidden_size) or state["lm_head.weight"].shape[0] != c.draft_vocab_size:
        raise SpecgraftError(f"head '{path}': weight shapes do not match its config.json "
                             f"(fc {tuple(state['fc.weight'].shape)}, lm_head {tuple(state['lm_head.weight'].shape)})")
    embed = state.pop("embed_tokens.weight", None)
    if embed is None:
        embed = target.get_input_embeddings().weight.detach().cpu()  # heads run on the CPU (docs/backends.md)
    head = Eagle3Head(c, embed.float())
    if "d2t" not in state:  # a head over the full vocabulary
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.vocab_size, dtype=torch.bool)
    state = {k: v for k, v in state.items() if not k.startswith("embed_tokens")}
    result = head.load_state_dict(state, strict=False)
    unexpected = [k for k in result.unexpected_keys]
    missing = [k for k in result.missing_keys if not k.startswith("embed_tokens")]
    if unexpected or missing:
        raise SpecgraftError(f"head '{path}': unexpected weights {unexpected[:4]}, missing {missing[:4]}")
    head.d2t, head.t2d = head.d2t.long(), head.t2d.bool()
    # a target that is not a torch module (llama.cpp's weights) names the dtype its heads run in
    return head.to(dtype or getattr(target, "head_dtype", None) or next(target.parameters()).dtype).eval()
