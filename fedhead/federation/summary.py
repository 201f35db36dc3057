"""A run's summary: per seed and over seeds (mean and standard deviation), from its rows."""

from __future__ import annotations

import numpy as np

from fedhead import __version__
from fedhead.core.central import first_reach
from fedhead.core.clientacc import CLIENT_FIELDS, LOCAL_FIELDS, UNSEEN_FIELDS
from fedhead.core.closedform import is_closed_form
from fedhead.core.dp import epsilon_schedule, summary_fields
from fedhead.core.personal import PERSONAL_FIELDS
from fedhead.federation.config import TrainConfig
from fedhead.federation.rundir import mean_std

SELECTION_TEXT = (
    "validation: selected_round, val_accuracy, acc95_round (on the validation curve against its final round) and "
    "rounds_to_99_central are read off the clients' validation parts; the test split is reported at the final round "
    "(final_accuracy) and at the selected round (test_accuracy_at_selected), never used to choose"
)
NO_SELECTION_TEXT = (
    "none: no validation part (--val-fraction 0, the paper recipe's protocol, clients too small to spare a sample, "
    "or secure aggregation); nothing "
    "is selected, final_accuracy is the test split at the final round, acc95_round is read off the test curve "
    "against the final round (the paper's protocol)"
)


CEILING_SLACK = 0.005  # a final accuracy more than half a point over the ceiling is flagged (exceeds_ceiling)


def ceiling_note(summary: dict) -> str | None:
    """One line when a seed's final test accuracy exceeds its tuned central ceiling by more than CEILING_SLACK."""
    over = [r for r in summary.get("per_seed", []) if r.get("exceeds_ceiling")]
    if not over:
        return None
    r = over[0]
    return (
        f"note: seed {r['seed']}'s final accuracy {r['final_accuracy']:.4f} is over its central ceiling "
        f"{r['central_accuracy']:.4f} ({r['central_method']}) by more than {100 * CEILING_SLACK:g} points "
        f"({len(over)} of {len(summary['per_seed'])} seeds): the ceiling is not one here (summary.json: "
        "exceeds_ceiling); a larger validation part or more central candidates may raise it."
    )


def with_ratios(rows: list[dict], central: dict | None = None) -> list[dict]:
    iid = {(r["seed"], r["round"]): r["accuracy"] for r in rows if r.get("run") == "iid"}
    out = []
    for r in rows:
        r = dict(r)
        ref = iid.get((r["seed"], r["round"]))
        if r.get("run") == "main" and ref:
            r["ratio_to_iid"] = r["accuracy"] / ref
        c = (central or {}).get(str(r["seed"]))
        if c and r.get("run") == "main" and c["accuracy"]:
            r["ratio_to_central"] = r["accuracy"] / c["accuracy"]
        out.append(r)
    return out


def _finite(v) -> bool:
    return v is not None and v == v and abs(float(v)) != float("inf")


def reach_round(rows: list[dict], key: str, reference: float) -> int | None:
    """The first round whose ``key`` reaches 0.95 x ``reference`` (Acc@95), rounds without it skipped."""
    for r in rows:
        if _finite(r.get(key)) and r[key] >= 0.95 * reference:
            return int(r["round"])
    return None


def selection(rows: list[dict], metric: str = "accuracy") -> dict:
    """What validation chooses in one unit's rows: the selected round (best validation ``metric``: highest accuracy
    or lowest loss, the earliest on a tie), its validation accuracy and loss, the test accuracy there, and Acc@95 on
    the validation curve against the final round's validation accuracy. Empty without validation."""
    evaluated = [r for r in rows if _finite(r.get("val_accuracy")) and r.get("stage") != "ccvr"]
    if not evaluated:
        return {}
    sign = -1.0 if metric == "loss" else 1.0
    key = f"val_{metric}"
    scored = [r for r in evaluated if _finite(r.get(key))] or evaluated
    best = max(scored, key=lambda r: (sign * float(r.get(key, float("nan"))), -int(r["round"])))
    return {
        "selected_round": int(best["round"]),
        "val_accuracy": float(best["val_accuracy"]),
        "val_loss": float(best["val_loss"]) if _finite(best.get("val_loss")) else None,
        "test_accuracy_at_selected": float(best["accuracy"]),
        "final_val_accuracy": float(evaluated[-1]["val_accuracy"]),
        "acc95_round": reach_round(evaluated, "val_accuracy", float(evaluated[-1]["val_accuracy"])),
    }


def seed_summary(rows: list[dict], seed: int, cfg: TrainConfig, realised: dict, central: dict | None) -> dict:
    """One seed's record of summary.json's ``per_seed``: its final test accuracy, what its validation selected, its
    ratios to the IID reference and the ceiling, costs and per-client accuracy."""
    metric = cfg.early_stop_metric or "accuracy"
    main = [r for r in rows if r["seed"] == seed and r["run"] == "main"]
    iid = [r for r in rows if r["seed"] == seed and r["run"] == "iid"]
    trained = [r for r in main if r.get("stage") != "ccvr"]
    chosen = selection(main, metric)
    on = "val_accuracy" if chosen else "accuracy"  # without validation: the test curve (the paper's protocol)
    rec = {
        "seed": seed,
        "final_accuracy": main[-1]["accuracy"],
        **chosen,
        "realised_noise_rate": realised.get(f"{seed}:main", 0.0),
        "client_ms": float(np.mean([r["client_ms"] for r in main])),
        "server_ms": float(np.mean([r["server_ms"] for r in main])),
        "bytes_total": int(sum(r["bytes_total"] for r in main)),
    }
    picked = [r["selected_params"] for r in main if r.get("selected_params")]
    if picked:  # --select-on-val: the regularisation the validation part chose
        rec["selected_params"] = picked[-1]
    if not chosen:
        rec["acc95_round"] = reach_round(trained, "accuracy", float(trained[-1]["accuracy"]))
    if len(trained) and int(trained[-1]["round"]) < (1 if is_closed_form(cfg.head) else cfg.rounds):
        rec["stopped_round"] = int(trained[-1]["round"])  # --early-stop ended it
    if iid:
        iid_final = iid[-1]["accuracy"]
        rec["iid_final_accuracy"] = iid_final
        rec["final_ratio_to_iid"] = rec["final_accuracy"] / iid_final if iid_final else None
        ref = iid[-1].get(on)
        rec["acc95_round_vs_iid"] = reach_round(trained, on, float(ref)) if _finite(ref) else None
    elif cfg.iid_reference:  # an IID run is its own reference
        rec["iid_final_accuracy"] = rec["final_accuracy"]
        rec["final_ratio_to_iid"] = 1.0
        rec["acc95_round_vs_iid"] = rec["acc95_round"]
    c = (central or {}).get(str(seed))
    if c:
        rec["central_accuracy"] = c["accuracy"]
        rec["central_method"] = c.get("method", "own")
        rec["central_own_accuracy"] = c.get("own_accuracy", c["accuracy"])
        rec["exceeds_ceiling"] = bool(rec["final_accuracy"] > c["accuracy"] + CEILING_SLACK)
        rec["final_ratio_to_central"] = rec["final_accuracy"] / c["accuracy"] if c["accuracy"] else None
        ref = c.get("val_accuracy") if chosen else c["accuracy"]  # reached on validation when there is one
        if _finite(ref):
            rec["rounds_to_99_central"], rec["mb_per_client_to_99_central"] = first_reach(main, 0.99 * ref, on)
        if chosen and _finite(c.get("val_accuracy")):
            rec["central_val_accuracy"] = c["val_accuracy"]
    if main[-1].get("stage") == "ccvr" and len(main) > 1:
        rec["uncalibrated_accuracy"] = main[-2]["accuracy"]
    rec["mb_per_client"] = float(sum(r["bytes_up_per_client"] for r in main)) / 1e6
    for k in (
        *CLIENT_FIELDS,
        *LOCAL_FIELDS,
        *UNSEEN_FIELDS,
        *PERSONAL_FIELDS,
    ):  # the last evaluated round's per-client accuracy (clientacc) and personal heads (--personalize)
        got = [r[k] for r in main if r.get(k) is not None and r[k] == r[k]]
        if got:
            rec[k] = got[-1]
    return rec


def summarize(rows: list[dict], cfg: TrainConfig, realised: dict, wall_s: float, central: dict | None = None) -> dict:
    per_seed = [seed_summary(rows, seed, cfg, realised, central) for seed in cfg.seeds]
    summary = {
        "head": cfg.head,
        "partition": cfg.partition,
        "recipe": cfg.recipe,
        "selection": SELECTION_TEXT if any("selected_round" in r for r in per_seed) else NO_SELECTION_TEXT,
        "seeds": cfg.seeds,
        "rounds": 1 if is_closed_form(cfg.head) else cfg.rounds,
        "clients": cfg.clients,
    }
    keys = [
        "final_accuracy",
        "selected_round",
        "val_accuracy",
        "val_loss",
        "test_accuracy_at_selected",
        "final_val_accuracy",
        "stopped_round",
        "acc95_round",
        "final_ratio_to_iid",
        "acc95_round_vs_iid",
        "iid_final_accuracy",
        "realised_noise_rate",
        "client_ms",
        "server_ms",
        "bytes_total",
        "central_accuracy",
        "central_own_accuracy",
        "central_val_accuracy",
        "final_ratio_to_central",
        "rounds_to_99_central",
        "mb_per_client_to_99_central",
        "uncalibrated_accuracy",
        "mb_per_client",
        *CLIENT_FIELDS,
        *LOCAL_FIELDS,
        *UNSEEN_FIELDS,
        *PERSONAL_FIELDS,
    ]
    if cfg.personalize:
        summary["personalize"] = cfg.personalize
    for k in keys:
        vals = [r.get(k) for r in per_seed]
        if all(v is None for v in vals):
            continue
        m, s = mean_std(vals)
        summary[k] = m
        summary[k + "_std"] = s
    if any("selected_params" in r for r in per_seed):
        summary["selected_params"] = "; ".join(f"seed {r['seed']}: {r.get('selected_params', '-')}" for r in per_seed)
    if any("central_method" in r for r in per_seed):
        methods = {r.get("central_method") for r in per_seed}
        summary["central_method"] = methods.pop() if len(methods) == 1 else ",".join(sorted(map(str, methods)))
        summary["exceeds_ceiling"] = any(r.get("exceeds_ceiling") for r in per_seed)
    summary.update(summary_fields(cfg, epsilon_schedule(cfg, summary["rounds"])))  # DP: final epsilon, delta
    summary["wall_seconds"] = wall_s
    summary["per_seed"] = per_seed
    summary["fedhead_version"] = __version__
    return summary
