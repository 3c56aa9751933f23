"""LOSSY verification rules (arXiv 2607.26627), each opt-in and each a small pure function of ``(p, q)``.

None of these rules reproduces the target distribution. Every result produced with one must sit next to its
*correct* baseline (:attr:`Rule.baseline`): truncation sampling of the target at the same parameter for the
truncation rules (SpecCascade -> min-p, typical acceptance -> eta), plain lossless decoding for the others.

Chain form (one draft ``x ~ q`` per position, ``p`` the target after temperature): accept ``x`` with
``a(x)``; on rejection emit from the fallback ``rho``. The induced ("output") distribution is

    pi(x) = q(x) a(x) + R rho(x),        R = 1 - sum_v q(v) a(v)

Tree form (deterministic candidates, the "q = 1" convention the lossy paper uses for EAGLE): walk the
siblings in order, accept sibling ``x`` with the gate ``g(x, r)``, on rejection set ``r[x] = 0`` and
renormalise; the bonus comes from the final ``r``. Rules that need ``q`` (CoS, interp-only, cap-only) have
no tree form and raise.

All vectors are float64 ``[V]``; ``p`` and ``q`` are probability vectors over the same vocabulary.

In our words, with the worked examples the tests assert: docs/design.md §6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import SpecgraftError

from ..core.verify import Gate  # (token, current r) -> acceptance probability


# ---- truncation sets (from the unmodified target p) ------------------------------------------------------

def minp_set(p: torch.Tensor, p_base: float) -> torch.Tensor:
    """``A = {v : p(v) >= p_base * max p}`` (HF ``MinPLogitsWarper``); bool ``[V]``."""
    return p >= p_base * p.max()


def eta_threshold(p: torch.Tensor, eps: float) -> float:
    """``min(eps, sqrt(eps) * exp(-H(p)))``, H in nats (HF ``EtaLogitsWarper``)."""
    pp = p[p > 0]
    entropy = float(-(pp * pp.log()).sum())
    return min(eps, math.sqrt(eps) * math.exp(-entropy))


def eta_set(p: torch.Tensor, eps: float) -> torch.Tensor:
    """``A = {v : p(v) >= eta_thr}``; the argmax always stays (as in HF, which keeps >= 1 token)."""
    keep = p >= eta_threshold(p, eps)
    keep[p.argmax()] = True
    return keep


def truncate(p: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``p_A = norm(p * 1_A)``: truncation sampling's distribution."""
    out = torch.where(keep, p, torch.zeros_like(p))
    return out / out.sum()


def _norm(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    s = x.sum()
    return x / s if s > 1e-15 else fallback


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The lossless residual ``norm((p - q)+)`` (``p`` itself when ``p == q``: rejection never happens)."""
    return _norm((p - q).clamp(min=0.0), p)


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    """``KL(a || b)`` in nats; ``inf`` when ``a`` puts mass where ``b`` has none."""
    m = a > 0
    if bool((b[m] <= 0).any()):
        return math.inf
    return float((a[m] * (a[m] / b[m]).log()).sum())


def lenience_delta(p: torch.Tensor, q: torch.Tensor, l: float) -> float:
    """Lenience's adaptive interpolation coefficient ``Delta = R / TV(p, q)`` in [0, 1] (1 when p == q)."""
    t = tv(p, q)
    if t <= 1e-15:
        return 1.0
    r = 1.0 - float(torch.minimum(q, p / l).sum())
    return min(1.0, max(0.0, r / t))


# ---- rules ------------------------------------------------------------------------------------------------

_PARAMS = {"p_base": False, "eps": True, "target_weight": False, "l": True, "lam": True}  # name -> open at 0


@dataclass(frozen=True)
class Rule:
    """A verification rule. Subclasses define ``accept_prob`` / ``fallback`` (chain) and ``tree_gate``.
    The base class is the lossless rule; every subclass is LOSSY and must define ``spec``."""

    name = "lossless"
    lossy = False
    needs_q = False  # True: no deterministic-candidate (tree) form

    def __post_init__(self) -> None:
        for key, open_low in _PARAMS.items():
            if hasattr(self, key):
                _check_unit(self.name, key, getattr(self, key), open_low)
        kind = getattr(self, "fallback_kind", "residual")
        if kind not in _FALLBACKS:
            raise SpecgraftError(f"fallback must be one of {', '.join(_FALLBACKS)}, got {kind!r}")

    def accept_prob(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``a(x)`` for every token ``x`` as the drafted one."""
        return torch.where(q > 0, (p / q.clamp(min=1e-300)).clamp(max=1.0), torch.ones_like(p))

    def fallback(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``rho``: the distribution a rejected position emits from."""
        return residual(p, q)

    def induced(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Closed-form chain output distribution ``q a + R rho``."""
        acc = q * self.accept_prob(p, q)
        return acc + (1.0 - float(acc.sum())) * self.fallback(p, q)

    def tree_gate(self, p: torch.Tensor) -> Gate:
        """The gate at a node whose (unmodified) target distribution is ``p``; sets are fixed from ``p``."""
        return lambda x, r: float(r[x])

    def baseline(self) -> tuple[str, float]:
        """The correct quality baseline: ("target", 0) = lossless decoding, ("min_p", v) / ("eta", v) =
        truncation sampling of the target at the same parameter, decoded losslessly."""
        return ("target", 0.0)

    def baseline_dist(self, p: torch.Tensor) -> torch.Tensor:
        kind, v = self.baseline()
        if kind == "min_p":
            return truncate(p, minp_set(p, v))
        if kind == "eta":
            return truncate(p, eta_set(p, v))
        return p

    @property
    def spec(self) -> str:
        if self.lossy:  # a lossy rule must never be recorded as "lossless"
            raise NotImplementedError(f"{type(self).__name__} must define spec")
        return "lossless"


_FALLBACKS = ("residual", "target_truncated", "draft_truncated", "target")


def _truncation_fallback(kind: str, p, q, keep) -> torch.Tensor:
    if kind == "target":
        return p
    if kind == "target_truncated":
        return truncate(p, keep)
    if kind == "draft_truncated":
        return _norm(torch.where(keep, q, torch.zeros_like(q)), truncate(p, keep))
    return _norm((p - q).clamp(min=0.0), truncate(p, keep))  # residual; p_A if degenerate


@dataclass(frozen=True)
class SpecCascade(Rule):
    """LOSSY. Accept ``x`` iff it lies in the target's min-p set (``a = 1_A``), fallback ``residual`` by
    default. Induced: ``pi = q 1_A + (1 - Z_q(A)) rho``; inside A the shape is the *draft's*. Tree gate:
    ``1[x in A]`` (the first sibling in A is emitted with probability 1). Baseline: min-p sampling."""

    p_base: float = 0.3
    fallback_kind: str = "residual"
    name = "speccascade"
    lossy = True

    def _set(self, p):
        return minp_set(p, self.p_base)

    def accept_prob(self, p, q):
        return self._set(p).double()

    def fallback(self, p, q):
        return _truncation_fallback(self.fallback_kind, p, q, self._set(p))

    def tree_gate(self, p):
        keep = self._set(p)
        return lambda x, r: float(keep[x])

    def baseline(self):
        return ("min_p", self.p_base)

    @property
    def spec(self):
        return f"lossy:speccascade:{self.p_base}" + ("" if self.fallback_kind == "residual"
                                                     else f":fallback={self.fallback_kind}")


@dataclass(frozen=True)
class Typical(Rule):
    """LOSSY. Medusa's typical acceptance with the eta threshold ``min(eps, sqrt(eps) exp(-H(p)))``.
    Chain: hard gate ``a = 1[p(x) >= thr]``, fallback ``p`` (Medusa samples the target; no residual).
    Tree: the soft gate ``min(1, p(x)/thr)`` of the lossy paper's EAGLE harness. Baseline: eta sampling."""

    eps: float = 0.09
    fallback_kind: str = "target"
    name = "typical"
    lossy = True

    def accept_prob(self, p, q):
        return (p >= eta_threshold(p, self.eps)).double()

    def fallback(self, p, q):
        return _truncation_fallback(self.fallback_kind, p, q, eta_set(p, self.eps))

    def tree_gate(self, p):
        thr = eta_threshold(p, self.eps)
        return lambda x, r: min(1.0, float(p[x]) / thr)

    def baseline(self):
        return ("eta", self.eps)

    @property
    def spec(self):
        return f"lossy:typical:{self.eps}" + ("" if self.fallback_kind == "target" else f":fallback={self.fallback_kind}")


@dataclass(frozen=True)
class CoS(Rule):
    """LOSSY. CoS weighted ensemble: ``pi = lam p + (1 - lam) q`` exactly. ``lam`` (``target_weight``) weights
    the TARGET: 1 is lossless, 0 is the draft. ``a = min(1, (lam p + (1-lam) q)/q)``, fallback the lossless
    residual. No cap: an overshooting draft keeps ``(1 - lam) q``. Chains only."""

    target_weight: float = 0.5
    name = "cos"
    lossy = True
    needs_q = True

    def accept_prob(self, p, q):
        lam = self.target_weight
        return super().accept_prob(lam * p + (1 - lam) * q, q)

    def tree_gate(self, p):
        raise SpecgraftError("lossy rule 'cos' needs draft probabilities: use a chain drafter")

    @property
    def spec(self):
        return f"lossy:cos:{self.target_weight}"


@dataclass(frozen=True)
class Lenience(Rule):
    """LOSSY. ``a = min(1, p/(l q))``, fallback the lossless residual. Induced, three regions:
    ``q <= p``: ``Delta p + (1 - Delta) q``; ``p < q < p/l``: ``q``; ``q >= p/l``: ``p/l`` (the cap).
    Tree gate ``min(1, r[x]/l)``. ``l = 1`` is lossless."""

    l: float = 0.5
    name = "lenience"
    lossy = True

    def accept_prob(self, p, q):
        return super().accept_prob(p / self.l, q)

    def tree_gate(self, p):
        return lambda x, r: min(1.0, float(r[x]) / self.l)

    @property
    def spec(self):
        return f"lossy:lenience:{self.l}"


@dataclass(frozen=True)
class InducedTarget(Rule):
    """LOSSY (for any ``pi != p``). Realise a target ``pi(p, q)`` exactly: lossless SD against ``pi`` (accept
    ``min(1, pi/q)``, fall back to ``norm((pi - q)+)``). Subclasses define ``target`` and ``spec``."""

    lossy = True
    needs_q = True

    def target(self, p, q) -> torch.Tensor:
        raise NotImplementedError

    def accept_prob(self, p, q):
        return super().accept_prob(self.target(p, q), q)

    def fallback(self, p, q):
        pi = self.target(p, q)
        return _norm((pi - q).clamp(min=0.0), pi)

    def tree_gate(self, p):
        raise SpecgraftError(f"lossy rule '{self.name}' needs draft probabilities: use a chain drafter")


@dataclass(frozen=True)
class InterpOnly(InducedTarget):
    """LOSSY ablation: lenience's adaptive coefficient as a global mixture, ``pi = Delta p + (1 - Delta) q``
    on all tokens (``Delta`` computed with ``l = lam``); no cap. ``lam = 1`` is lossless."""

    lam: float = 0.5
    name = "interp"

    def target(self, p, q):
        d = lenience_delta(p, q, self.lam)
        return d * p + (1 - d) * q

    @property
    def spec(self):
        return f"lossy:interp:{self.lam}"


@dataclass(frozen=True)
class CapOnly(InducedTarget):
    """LOSSY ablation: ``pi ∝ 1_U (lam p + (1 - lam) q) + 1_O min(q, p/lam)`` with ``U = {q <= p}``,
    ``O = {q > p}``: a fixed interpolation where the draft underestimates, the lenience cap where it
    overshoots. ``lam = 1`` is lossless."""

    lam: float = 0.5
    name = "cap"

    def target(self, p, q):
        lam = self.lam
        pi = torch.where(q <= p, lam * p + (1 - lam) * q, torch.minimum(q, p / lam))
        return pi / pi.sum()

    @property
    def spec(self):
        return f"lossy:cap:{self.lam}"


@dataclass(frozen=True)
class Combined(Rule):
    """LOSSY. Truncation inside, cap outside: ``a = 1`` on the min-p set A, ``min(1, p/(l q))`` outside;
    fallback the lossless residual. Induced: ``q 1_A + min(q, p/l) 1_notA + R norm((p - q)+)``.
    Tree gate: ``1`` in A, else ``min(1, r[x]/l)``."""

    p_base: float = 0.3
    l: float = 0.5
    name = "combined"
    lossy = True

    def accept_prob(self, p, q):
        return torch.where(minp_set(p, self.p_base), torch.ones_like(p), super().accept_prob(p / self.l, q))

    def tree_gate(self, p):
        keep = minp_set(p, self.p_base)
        return lambda x, r: 1.0 if keep[x] else min(1.0, float(r[x]) / self.l)

    @property
    def spec(self):
        return f"lossy:combined:{self.p_base}" + ("" if self.l == 0.5 else f":l={self.l}")


RULES: dict[str, tuple[type, str]] = {  # name -> (class, the PARAM field); ranges are checked on construction
    "speccascade": (SpecCascade, "p_base"),
    "typical": (Typical, "eps"),
    "cos": (CoS, "target_weight"),
    "lenience": (Lenience, "l"),
    "interp": (InterpOnly, "lam"),
    "cap": (CapOnly, "lam"),
    "combined": (Combined, "p_base"),
}


def _check_unit(name: str, key: str, v: float, open_low: bool) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and (0 < v <= 1 if open_low else 0 <= v <= 1)):
        rng = "(0, 1]" if open_low else "[0, 1]"
        raise SpecgraftError(f"lossy rule '{name}': {key} must be in {rng}, got {v!r}")


def parse_rule(spec: "str | Rule | None") -> Rule:
    """``"lossless"`` (default) or ``"lossy:RULE:PARAM[:key=value,...]"``, e.g. ``lossy:lenience:0.5``,
    ``lossy:speccascade:0.3:fallback=target_truncated``, ``lossy:combined:0.3:l=0.5``."""
    if spec is None or isinstance(spec, Rule):
        return spec or Rule()
    if not isinstance(spec, str):
        raise SpecgraftError(f"verify must be 'lossless' or 'lossy:RULE:PARAM', got {spec!r}")
    parts = [x.strip() for x in spec.strip().split(":")]
    if parts == ["lossless"]:
        return Rule()
    if parts[0] != "lossy" or len(parts) < 3 or len(parts) > 4:
        raise SpecgraftError(f"verify must be 'lossless' or 'lossy:RULE:PARAM[:key=value,...]' "
                             f"(RULE one of {', '.join(RULES)}), got {spec!r}")
    name, raw = parts[1], parts[2]
    if name not in RULES:
        raise SpecgraftError(f"unknown lossy rule '{name}'; choose one of: {', '.join(RULES)}")
    cls, key = RULES[name]
    try:
        value = float(raw)
    except ValueError:
        raise SpecgraftError(f"lossy rule '{name}': {key} must be a number, got {raw!r}") from None
    kwargs: dict = {key: value}
    if len(parts) == 4 and not parts[3]:
        raise SpecgraftError(f"empty option list in {spec!r}")
    for item in filter(None, (parts[3] if len(parts) == 4 else "").split(",")):
        k, eq, v = (x.strip() for x in item.partition("="))
        if (k == "fallback" and "fallback_kind" in kwargs) or (k == "l" and name == "combined" and "l" in kwargs):
            raise SpecgraftError(f"option '{k}' given twice in {spec!r}")
        if not eq:
            raise SpecgraftError(f"bad lossy option '{item}' (expected key=value)")
        if k == "fallback" and name in ("speccascade", "typical"):
            kwargs["fallback_kind"] = v
        elif k == "l" and name == "combined":
            try:
                kwargs["l"] = float(v)
            except ValueError:
                raise SpecgraftError(f"lossy rule 'combined': l must be a number, got {v!r}") from None
        else:
            raise SpecgraftError(f"lossy rule '{name}' has no option '{k}'")
    return cls(**kwargs)


def tree_node_yield(rule: Rule, p: torch.Tensor, child_tokens: list[int]) -> torch.Tensor:
    """Exact distribution of the token a node emits under ``rule``'s tree gate (q = 1 convention): the
    accepted child's token, or the bonus from the final ``r``. The oracle for
    :func:`~specgraft.lossy.verify.lossy_tree`. ``child_tokens`` in sibling order; duplicates are skipped as the
    verifier skips them."""
    gate = rule.tree_gate(p)
    out = torch.zeros_like(p)
    remaining, r = 1.0, p.clone()
    for x in dict.fromkeys(child_tokens):
        a = gate(x, r)
        out[x] += remaining * a
        remaining *= 1.0 - a
        r[x] = 0.0
        total = r.sum()
        if total <= 0:
            r = p
            break
        r = r / total
    return out + remaining * r


GRID = ("lossy:speccascade:0.1;lossy:speccascade:0.3;lossy:speccascade:0.5;lossy:speccascade:0.9;"
        "lossy:typical:0.05;lossy:typical:0.1;lossy:typical:0.2;lossy:lenience:0.2;lossy:lenience:0.5;"
        "lossy:lenience:0.8;lossy:combined:0.3;lossy:cos:0.8;lossy:cos:0.5;lossy:cos:0.2;lossy:interp:0.2;"
        "lossy:interp:0.5;lossy:cap:0.2;lossy:cap:0.5")
