"""The lossy study's report on synthetic records whose answers are known: pairing, intervals, efficiency ratios
from groups, and each verdict rule (reproduced, contradicted, unresolved)."""

import math
import random

import pytest

from specgraft.eval.lossy_study import (CLAIMS, MIN_N, markdown, paired_quality, points, problems_for_se,
                                        study_rows, verdict, verdict_table)

N = 200  # problems
TREE = "budget=8,depth=4,shape=tree,top_k=3"


def record(label: str, method: str, verify: str, k: int, value: int, sampling: dict, mat: int = 3,
           group_tokens: int = 100, group_wall: float = 10.0, batch: int = 4) -> dict:
    steps = 10
    return {"dataset": "gsm8k" if k % 2 else "humaneval", "prompt_id": str(k), "seed": 0, "label": label,
            "method": method, "model": "m", "verify": verify, "lossy": verify != "lossless",
            "sampling": {"temperature": 0.7, "top_k": 0, "top_p": 1.0, **sampling}, "quality": {"value": value},
            "steps": steps, "accept_lengths": [mat - 1] * steps, "new_tokens": steps * mat, "wall_s": 1.0,
            "batch": {"group": k // batch, "new_tokens": group_tokens, "wall_s": group_wall}, "_file": "f"}


def build(values: dict[str, list[int]], mats: dict[str, int] | None = None,
          walls: dict[str, float] | None = None) -> list[dict]:
    """``values[label]``: the score of each problem. Labels follow the bench's naming."""
    recs = []
    for label, vals in values.items():
        name, _, rest = label.partition(":")
        opts = dict(x.split("=", 1) for x in rest.split(",") if x) if rest else {}
        verify = opts.pop("verify", "lossless")
        sampling = {k: float(opts.pop(k)) for k in ("min_p", "eta") if k in opts}
        for k, v in enumerate(vals):
            recs.append(record(label, name, verify, k, v, sampling, (mats or {}).get(label, 3),
                               group_wall=(walls or {}).get(label, 10.0)))
    return recs


def flip(vals: list[int], share: float, seed: int) -> list[int]:
    """A copy with ``share`` of the 1s turned to 0 (a drop of about that many points times the accuracy)."""
    rng = random.Random(seed)
    return [0 if v and rng.random() < share else v for v in vals]


def churn(vals: list[int], down: float, up: float, seed: int) -> list[int]:
    """Answers that change both ways: a noisy point whose mean moves little."""
    rng = random.Random(seed)
    return [(0 if rng.random() < down else 1) if v else (1 if rng.random() < up else 0) for v in vals]


def base_values(seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [int(rng.random() < 0.7) for _ in range(N)]


def test_paired_quality_golden():
    recs = build({"draft": [1, 1, 0, 1], "draft:verify=lossy:cos:0.4": [1, 0, 0, 0]})
    pts = points(recs)
    cos = next(p for p in pts.values() if p.label.endswith("cos:0.4"))
    base = next(p for p in pts.values() if p.label == "draft")
    d = paired_quality(cos, base)
    # differences 0, -1, 0, -1: mean -0.5, sd 0.5774, se 0.2887
    assert d["n"] == 4 and d["mean"] == pytest.approx(-0.5) and d["se"] == pytest.approx(0.57735 / 2, rel=1e-4)
    assert -1.0 <= d["lo"] <= d["mean"] <= d["hi"] <= 0.0
    # the same spread needs n se^2 / 0.03^2 = 4 * 0.08333 / 0.0009 = 370.4 -> 371 problems for an SE of 3 points
    assert problems_for_se(d) == 371 and "| 4 | 371 |" in markdown(recs)
    assert problems_for_se({**d, "se": 0.01}) == 4  # already below the goal: no fewer than it has
    assert problems_for_se({**d, "n": 1, "se": math.nan}) is None


def test_verdicts_follow_the_stated_rules():
    base = base_values()
    values = {
        "ar": base_values(1), "draft": base,
        "draft:verify=lossy:cos:0.4": flip(base, 0.4, 2),  # a clear drop: reproduced
        "draft:verify=lossy:lenience:0.6": list(base),  # identical: no drop, reproduced
        "draft:verify=lossy:lenience:0.2": flip(base, 0.4, 3),  # a drop where none is claimed: contradicted
        "draft:verify=lossy:interp:0.2": list(base),  # no drop where a collapse is claimed: contradicted
        "draft:verify=lossy:cap:0.2": churn(base, 0.2, 0.43, 4),  # noisy, near 0: unresolved
        "draft:verify=lossy:combined:0.3": list(base),  # no drop, MAT 4 vs 3: reproduced
    }
    recs = build(values, mats={"draft:verify=lossy:combined:0.3": 4}, walls={"ar": 5.0})
    rows, pts = study_rows(recs), points(recs)
    got = {c.rule: verdict(c, rows, pts)[1].split(" ")[0] for c in CLAIMS}
    assert got == {"lossy:speccascade:0.1": "unresolved", "lossy:typical:0.1": "unresolved",
                   "lossy:cos:0.4": "reproduced", "lossy:lenience:0.6": "reproduced",
                   "lossy:lenience:0.2": "contradicted", "lossy:interp:0.2": "contradicted",
                   "lossy:cap:0.2": "unresolved", "lossy:combined:0.3": "reproduced"}
    comb = next(r for r in rows if r["label"].endswith("combined:0.3"))
    assert comb["mat_vs_base"]["ratio"] == pytest.approx(4 / 3) and comb["mat_vs_base"]["lo"] == pytest.approx(4 / 3)
    # every point ran at group throughput 100/10; AR at 100/5: half AR's speed, exactly, in every resample
    assert comb["vs_ar"]["ratio"] == pytest.approx(0.5) and comb["vs_ar"]["n"] == N // 4
    table = verdict_table(recs)
    assert table.count("\n") == len(CLAIMS) + 2 and "**reproduced" in table and "**contradicted" in table
    assert "| draft:verify=lossy:cos:0.4 | **lossy** | chain |" in markdown(recs)


def test_tree_vs_chain_gap_and_small_samples():
    base = base_values()
    values = {"draft": base, "draft:min_p=0.1": base, f"draft:{TREE},min_p=0.1": base,
              "draft:verify=lossy:speccascade:0.1:fallback=draft_truncated": list(base),
              f"draft:{TREE},verify=lossy:speccascade:0.1": flip(base, 0.3, 5)}
    recs = build(values)
    rows, pts = study_rows(recs), points(recs)
    tree = next(r for r in rows if r["tree"] and r["lossy"])
    assert tree["baseline"] == f"draft:{TREE},min_p=0.1"  # a tree rule pairs with the tree baseline
    ours, v = verdict(CLAIMS[0], rows, pts)
    assert v.startswith("reproduced") and "tree − chain" in ours
    few = [r for r in recs if int(r["prompt_id"]) < MIN_N // 2]
    assert "unresolved (n = " in verdict(CLAIMS[0], study_rows(few), points(few))[1]
    assert all(not math.isnan(r["mat"]) for r in rows)


def test_speed_pairs_groups_of_the_same_problems_and_unbatched_records():
    """Groups pair only with the reference's group on the same problems (a resumed group's rerun, with fewer
    problems, is left out); records of an unbatched run are each their own group; intervals have width when
    the groups' throughputs vary."""
    base = base_values()
    recs = build({"ar": base, "draft": base})
    rng = random.Random(7)
    for r in recs:  # every group of "draft" at its own speed, about twice AR's
        if r["label"] == "draft":
            r["batch"]["wall_s"] = 5.0 * (1 + 0.2 * ((int(r["prompt_id"]) // 4) % 3))
        r["batch"]["id"] = f"{r['label']}-{int(r['prompt_id']) // 4}"
    resumed = [r for r in recs if r["label"] == "draft" and r["prompt_id"] in ("0", "1")]
    for r in resumed:  # group 0 of draft reran two of its four problems under a new id
        r["batch"] = {**r["batch"], "id": "rerun", "wall_s": 100.0}
    row = next(r for r in study_rows(recs) if r["label"] == "draft")
    assert row["vs_ar"]["n"] == N // 4 - 1  # the rerun group is not paired with AR's full group 0
    assert 1.5 < row["vs_ar"]["lo"] < row["vs_ar"]["ratio"] < row["vs_ar"]["hi"] < 2.1
    plain = build({"ar": base, "draft": base}, walls={"ar": 2.0})
    for r in plain:
        del r["batch"]
        r["wall_s"] = 2.0 if r["label"] == "ar" else 1.0 + rng.random()
    row = next(r for r in study_rows(plain) if r["label"] == "draft")
    assert row["vs_ar"]["n"] == N and 1.2 < row["vs_ar"]["lo"] < row["vs_ar"]["hi"] < 1.5


def test_a_drop_smaller_than_claimed_is_labelled_so():
    base = base_values()
    recs = build({"draft": base, "draft:verify=lossy:interp:0.2": flip(base, 0.06, 9)})
    ours, v = verdict(next(c for c in CLAIMS if c.rule == "lossy:interp:0.2"), study_rows(recs), points(recs))
    assert v.startswith("reproduced in direction, smaller than claimed") and "Δ -" in ours
