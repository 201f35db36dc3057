"""A head of one's own, run through fedhead without editing it (docs/extending.md)."""

import sys

import torch.nn.functional as F

import fedhead
from fedhead import Param, TrainConfig


@fedhead.register_head("smooth-softmax", Param("smoothing", 0.1, None, "label smoothing of the targets"))
class SmoothSoftmax(fedhead.Head):
    """Softmax cross-entropy with label smoothing."""

    def per_sample(self, logits, y, ctx):  # logits [K clients, B samples, C classes]
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none", label_smoothing=self.params["smoothing"])


# a named method for `fedhead bench baselines --methods smooth+ridge`
fedhead.register_method(
    "smooth+ridge", "label-smoothed softmax from a Fed3R start", head="smooth-softmax", init="ridge"
)

if __name__ == "__main__":
    store, out = sys.argv[1], sys.argv[2]
    res = fedhead.run(
        TrainConfig(
            features=store,
            head="smooth-softmax",
            init="ridge",
            partition="shard",
            partition_params={"shards_per_client": 1},
            clients=20,
            rounds=3,
            central_reference=True,
        ),
        out=out,
    )
    for row in res.rows:
        print(row["round"], row["stage"], f"{row['accuracy']:.4f}")
    print("ratio to central:", round(res.summary["final_ratio_to_central"], 4))
