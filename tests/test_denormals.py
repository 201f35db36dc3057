"""No training state falls into subnormal floats (issue 24): checked by values, in fresh processes whose intra-op
thread pool starts before fedhead runs (as in a user's program), with a control run that keeps subnormals
(``FEDHEAD_DENORMALS=keep``) to show the same run does produce them when nothing flushes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A decaying state: OvA heads on large non-negative features, AdamW at lr 0.1, ten rounds. Every optimizer step's
# state (heads, gradients, both moments) is read bit by bit: exponent bits 0 and mantissa bits not 0.
HEAD_ENGINE = r"""
import json, sys
import numpy as np
import torch

torch.set_num_threads(2)
torch.randn(10**6).mul(2)              # the pool exists before fedhead's first round

import fedhead.core.engine as E
from fedhead.core.heads import create_head
from fedhead.core.partitions import class_counts, create_partition


def subnormal(t):
    b = t.detach().float().contiguous().view(torch.int32)
    return int((((b & 0x7F800000) == 0) & ((b & 0x007FFFFF) != 0)).sum())


found = {"vectorized": 0, "loop": 0}
step = E.StackedAdamW.step


def counted_step(self, k):
    step(self, k)
    found["vectorized"] += sum(subnormal(t[:k]) for t in (self.w, self.g, self.m, self.v))


E.StackedAdamW.step = counted_step
make = E.make_torch_optimizer


def counted_optimizer(cfg, params):
    opt = make(cfg, params)
    inner = opt.step

    def counted(*a, **kw):
        out = inner(*a, **kw)
        for p in params:
            st = opt.state[p]
            found["loop"] += subnormal(p) + subnormal(p.grad) + subnormal(st["exp_avg"]) + subnormal(st["exp_avg_sq"])
        return out

    opt.step = counted
    return opt


E.make_torch_optimizer = counted_optimizer
g = torch.Generator().manual_seed(0)
N, D, C, K = 1000, 64, 10, 10
x = torch.empty(N, D + 1)
x[:, :D] = torch.randn(N, D, generator=g).abs_() * 4
x[:, D] = 1
y = np.arange(N) % C
parts = create_partition("shard", y, K, seed=0, shards_per_client=2)
data = E.ClientSet(x=x, y=torch.as_tensor(y), parts=parts, counts=class_counts(parts, y, C), num_classes=C)
for backend in ("vectorized", "loop"):
    eng = E.Engine(data, create_head("ova2"), E.OptimConfig(name="adamw", lr=0.1, weight_decay=1e-4),
                   E.LocalConfig(3, 50), backend=backend)
    theta = torch.zeros(C, D + 1)
    for r in range(1, 11):
        theta, _ = eng.run_round(theta, np.arange(K), 0, r, "fedavg")
print(json.dumps(found))
"""

# The scratch engine: after its local training every intra-op thread flushes (the same probe fedhead uses).
SCRATCH_ENGINE = r"""
import json
import numpy as np
import torch

torch.set_num_threads(2)
torch.randn(10**6).mul(2)

from fedhead.scratch.engine import OptimSpec, init_params, softmax_ce, train_members
from fedhead.scratch.models import create_model
from fedhead.infra.devices import _pool_flushes

model = create_model("fedabc-mlp", (1, 8, 8), 10)
params = init_params(model, torch.Generator().manual_seed(0), count=2)
x = torch.randn(64, 1, 8, 8)
y = torch.arange(64) % 10
train_members(model, params, [np.arange(32), np.arange(32, 64)], {}, softmax_ce, x_all=x, y_all=y,
              to_float=lambda t: t, epochs=1, batch_size=16, optim=OptimSpec("sgd", 0.01),
              rng=np.random.default_rng(0))
print(json.dumps({"flushes": _pool_flushes()}))
"""


def _run(script: str, keep: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FEDHEAD_DENORMALS"}
    if keep:
        env["FEDHEAD_DENORMALS"] = "keep"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@pytest.mark.slow
@pytest.mark.skipif(not _x86(), reason="flush-to-zero is an x86 mode (torch.set_flush_denormal)")
def test_decaying_optimizer_state_holds_no_subnormal_numbers():
    kept = _run(HEAD_ENGINE, keep=True)
    assert kept["vectorized"] > 0 and kept["loop"] > 0, kept  # the control: this run does decay into them
    assert _run(HEAD_ENGINE, keep=False) == {"vectorized": 0, "loop": 0}


@pytest.mark.skipif(not _x86(), reason="flush-to-zero is an x86 mode (torch.set_flush_denormal)")
def test_scratch_engine_leaves_every_thread_flushing():
    assert _run(SCRATCH_ENGINE, keep=True) == {"flushes": False}
    assert _run(SCRATCH_ENGINE, keep=False) == {"flushes": True}
