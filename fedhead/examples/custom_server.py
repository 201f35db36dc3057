"""A server update of one's own that keeps state across rounds (docs/extending.md)."""

import sys

import torch

import fedhead
from fedhead import ServerOptimizer, TrainConfig


@fedhead.register_server_optimizer("fedams")
class FedAMS(ServerOptimizer):
    """FedAMS (Wang et al. 2022): FedAdam with AMSGrad's running maximum of the second moment, so the server's
    step size never grows back. Its state (m, v, v_max) is checkpointed with the run and resumes with it."""

    defaults = {"lr": 0.1, "betas": (0.9, 0.99), "tau": 1e-3}  # the --server-* options it takes
    state_keys = ("m", "v", "v_max")

    def setup(self):
        self.m, self.v, self.v_max = self.zeros(), self.zeros(), self.zeros()

    def update(self, x, a):  # x: the head before the round, a: the clients' aggregate (float64)
        (b1, b2), d = self.cfg.betas, a - x
        self.m = b1 * self.m + (1 - b1) * d
        self.v = b2 * self.v + (1 - b2) * d * d
        self.v_max = torch.maximum(self.v_max, self.v)
        return x + self.cfg.lr * self.m / (self.v_max.sqrt() + self.cfg.tau)


# a named method for `fedhead bench baselines --methods ova2-fedams`
fedhead.register_method("ova2-fedams", "OvA-LP with the FedAMS server update", head="ova2", server_opt="fedams")

if __name__ == "__main__":
    store, out = sys.argv[1], sys.argv[2]
    res = fedhead.run(
        TrainConfig(
            features=store,
            server_opt="fedams",
            server_lr=0.05,
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
