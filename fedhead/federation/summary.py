"""A run's summary: per seed and over seeds (mean and standard deviation), from its rows."""

from __future__ import annotations

import numpy as np

from fedhead import __version__
from fedhead.core.central import first_reach
from fedhead.core.clientacc import CLIENT_FIELDS, UNSEEN_FIELDS
from fedhead.core.closedform import is_closed_form
from fedhead.core.dp import epsilon_schedule, summary_fields
from fedhead.federation.config import TrainConfig
from fedhead.federation.rundir import acc95_round, mean_std


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


def summarize(rows: list[dict], cfg: TrainConfig, realised: dict, wall_s: float, central: dict | None = None) -> dict:
    per_seed = []
    for seed in cfg.seeds:
        main = [r for r in rows if r["seed"] == seed and r["run"] == "main"]
        iid = [r for r in rows if r["seed"] == seed and r["run"] == "iid"]
        accs = [r["accuracy"] for r in main if r["accuracy"] == r["accuracy"]]
        rec = {
            "seed": seed,
            "final_accuracy": main[-1]["accuracy"],
            "best_accuracy": max(accs),
            "acc95_round": acc95_round(accs),
            "realised_noise_rate": realised.get(f"{seed}:main", 0.0),
            "client_ms": float(np.mean([r["client_ms"] for r in main])),
            "server_ms": float(np.mean([r["server_ms"] for r in main])),
            "bytes_total": int(sum(r["bytes_total"] for r in main)),
        }
        if iid:
            iid_final = iid[-1]["accuracy"]
            rec["iid_final_accuracy"] = iid_final
            rec["final_ratio_to_iid"] = rec["final_accuracy"] / iid_final if iid_final else None
            rec["acc95_round_vs_iid"] = acc95_round(accs, reference=iid_final)
        elif cfg.iid_reference:  # an IID run is its own reference
            rec["iid_final_accuracy"] = rec["final_accuracy"]
            rec["final_ratio_to_iid"] = 1.0
            rec["acc95_round_vs_iid"] = rec["acc95_round"]
        c = (central or {}).get(str(seed))
        if c:
            rec["central_accuracy"] = c["accuracy"]
            rec["final_ratio_to_central"] = rec["final_accuracy"] / c["accuracy"] if c["accuracy"] else None
            rec["rounds_to_99_central"], rec["mb_per_client_to_99_central"] = first_reach(main, 0.99 * c["accuracy"])
        if main[-1].get("stage") == "ccvr" and len(main) > 1:
            rec["uncalibrated_accuracy"] = main[-2]["accuracy"]
        rec["mb_per_client"] = float(sum(r["bytes_up_per_client"] for r in main)) / 1e6
        for k in (*CLIENT_FIELDS, *UNSEEN_FIELDS):  # the last evaluated round's per-client accuracy (clientacc)
            got = [r[k] for r in main if r.get(k) is not None and r[k] == r[k]]
            if got:
                rec[k] = got[-1]
        per_seed.append(rec)
    summary = {
        "head": cfg.head,
        "partition": cfg.partition,
        "recipe": cfg.recipe,
        "seeds": cfg.seeds,
        "rounds": 1 if is_closed_form(cfg.head) else cfg.rounds,
        "clients": cfg.clients,
    }
    keys = [
        "final_accuracy",
        "best_accuracy",
        "acc95_round",
        "final_ratio_to_iid",
        "acc95_round_vs_iid",
        "iid_final_accuracy",
        "realised_noise_rate",
        "client_ms",
        "server_ms",
        "bytes_total",
        "central_accuracy",
        "final_ratio_to_central",
        "rounds_to_99_central",
        "mb_per_client_to_99_central",
        "uncalibrated_accuracy",
        "mb_per_client",
        *CLIENT_FIELDS,
        *UNSEEN_FIELDS,
    ]
    for k in keys:
        vals = [r.get(k) for r in per_seed]
        if all(v is None for v in vals):
            continue
        m, s = mean_std(vals)
        summary[k] = m
        summary[k + "_std"] = s
    summary.update(summary_fields(cfg, epsilon_schedule(cfg, summary["rounds"])))  # DP: final epsilon, delta
    summary["wall_seconds"] = wall_s
    summary["per_seed"] = per_seed
    summary["fedhead_version"] = __version__
    return summary
