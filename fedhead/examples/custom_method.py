"""An aggregation rule of one's own, run through fedhead without editing it (docs/extending.md)."""

import sys

import fedhead
from fedhead import Aggregator, TrainConfig


@fedhead.register_aggregator("fedexp")
class FedExP(Aggregator):
    """FedExP (Jhunjhunwala et al. 2023): the clients' mean update, extrapolated by the server step
    max(1, sum_k ||d_k||^2 / (2 M (||mean d||^2 + eps)))."""

    eps = 1e-4

    def message(self, theta, trained, sizes, holds):  # per client [K, ...]; the server sees only their sums
        d = trained - theta
        return {"delta": d, "sq": (d * d).sum((1, 2))}

    def update(self, previous, totals):
        m = totals.clients
        mean = totals.sums["delta"] / m
        step = max(1.0, float(totals.sums["sq"]) / (2 * m * (float((mean * mean).sum()) + self.eps)))
        return (previous + step * mean).to(previous.dtype)


# a named method for `fedhead bench baselines --methods ova2-fedexp`
fedhead.register_method("ova2-fedexp", "OvA-LP aggregated by FedExP", head="ova2", aggregate="fedexp")

if __name__ == "__main__":
    store, out = sys.argv[1], sys.argv[2]
    res = fedhead.run(
        TrainConfig(
            features=store,
            aggregate="fedexp",
            partition="shard",
            clients=10,
            rounds=3,
            partition_params={"shards_per_client": 2},
            central_reference=True,
        ),
        out=out,
    )
    print("accuracy per round:", [round(r["accuracy"], 4) for r in res.rows])
    print("ratio to central:", round(res.summary["final_ratio_to_central"], 4))
