"""Bad-input matrix over every command: each bad input is refused the project's way.

Every case runs one command in-process (typer's ``CliRunner``; click >= 8.2 keeps ``result.stderr`` apart
from stdout) on tiny inputs and asserts:

* a non-zero exit, and no exception other than ``SystemExit`` escaped to the runner;
* exactly one line on stderr, ``error: <message>``, short, naming what is wrong (``Case.expect``);
* no ``Traceback`` and no ``internal error`` anywhere in the output;
* nothing under the final output name: the ``--out`` path given is byte-for-byte as before (absent if it was
  absent; a pre-existing file or folder unchanged), no ``<out>.lock`` is left, and the working directory (a
  fresh empty folder, where the default outputs ``runs/``, ``reports/``, ``cache/`` would go) stays empty.

A case marked ``bug`` fails one of these today: it is ``xfail(strict=True)`` so that this file can be committed
while the owner fixes it; the marker comes off with the fix (a fixed case XPASSes, which fails strictly).

Some commands reach slow machinery before some of their checks; it is replaced by stand-ins that keep the
command's own control flow:

* ``flower simulate`` and ``bench flower``: Flower's ``run_simulation`` is replaced by a stand-in that records
  the call and runs the ServerApp's main with a grid that refuses any use (no Ray in the tests). A bad input must
  be refused before ``run_simulation`` starts: a real run prints Flower's multi-line deprecation warning and
  Ray's logs on stderr first, and takes 15 s or more before the ServerApp validates anything.
* ``demo`` (cases marked ``fake="demo"``): the extraction of the digits with EfficientNet-Lite0 (about 25 s here)
  writes a tiny synthetic store where the real one would go.
* ``bench speed`` (all cases): the measurement (about 20 s even with ``--quick``) returns an empty record.
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import cli

runner = CliRunner()
MAX_MESSAGE = 600  # characters of the one error line (store and layout messages carry a path and a fix)


@dataclass(frozen=True)
class Case:
    base: str  # the command and the valid options around the bad one ({placeholders} allowed)
    bad: str  # the bad input (appended: for single-valued options the last one given wins)
    expect: str  # substring of the error line, naming the parameter or the problem
    bug: str | None = None  # "BUG: ..." -> xfail(strict=True)
    fake: str | None = None  # "demo": stand-in extraction for ``fedhead demo``
    name: str | None = None  # the case's name when ``bad`` alone does not say it

    @property
    def command(self) -> str:
        words = self.base.split()
        return " ".join(words[:2]) if words[0] in ("bench", "flower") else words[0]

    @property
    def id(self) -> str:
        return f"{self.command}: {self.name or self.bad}"


# ---------------------------------------------------------------- the matrix

EXTRACT = "extract --dataset imagefolder --data-dir {imgs} --encoder test_efficientnet --no-pretrained --out {out}.h5"
EXTRACT_ENC = EXTRACT + " --image-size 32"  # cases that get as far as encoding
TRAIN = "train --features {store} --clients 10 --rounds 1 --out {out}"
SYNTH = "synth --num-classes 2 --train-per-class 2 --test-per-class 2 --dim 2 --no-probe --out {out}.h5"
DEMO = "demo --out {out}"
SCRATCH = "scratch fedavg --dataset imagefolder --data-dir {imgs} --clients 2 --rounds 1 --out {out}"
DNC = (
    "scratch dnc --dataset imagefolder --data-dir {imgs} --clients 2 --rounds 1 --prepass-rounds 1 "
    "--feature-epochs 1 --finetune-epochs 1 --out {out}"
)
FEDPROX = "scratch fedprox --dataset imagefolder --data-dir {imgs} --clients 2 --rounds 1 --partition iid --out {out}"
FEDPER, FEDREP, FEDROD, SCAFFOLD = (
    FEDPROX.replace("fedprox", algo) for algo in ("fedper", "fedrep", "fedrod", "scaffold")
)
GRID = "--features {store} --quick --clients 10 --rounds 1 --out {out}"
ABLATION = "bench ablation " + GRID + " --head ova2 --partition shard-1 --recipe default"
PARTITIONS = "bench partitions " + GRID + " --partition shard-1"
ENCODERS = "bench encoders " + GRID + " --partition shard-1"
NOISE = "bench noise " + GRID + " --head ova2 --sym-rates 0.3 --asym-rates ''"
PARTICIPATION = "bench participation " + GRID + " --rates 0.5"
GEOMETRY = "bench geometry --features {store} --quick --samples-per-class 5 --out {out}"
OPENSET = "bench openset --features {store} --seeds 0 --clients 4 --rounds 1 --out {out}"
SPEED = "bench speed --quick --no-extraction --rounds 1 --loop-rounds 0 --out {out}.json"
BENCH_EXTRACT = (
    "bench extract --dataset imagefolder --data-dir {imgs} --encoder test_efficientnet --image-size 32 "
    "--num-images 4 --repeats 1 --batch-size 4 --device cpu --out {out}.json"
)
DEPLOY = "bench deploy --nodes 3 --rounds 3 --out {out}"
BENCH_FLOWER = (
    "bench flower --clients 4 --rounds 1 --num-classes 4 --train-per-class 10 --dim 4 --partition iid --out {out}"
)
BASELINES = "bench baselines " + GRID + " --methods ova2 --partition iid"
PRIVACY = "bench privacy " + GRID + " --methods ncm --partition iid --epsilons 8 --secagg-clients 0"
SIMULATE = "flower simulate --features {store} --clients 2 --rounds 1 --out {out}"
PAPERS = "bench papers dnc --data-dir {imgs} --quick --out {out}"  # {imgs} has CIFAR-10's folder layout
DP = "--dp-noise-multiplier 1 --dp-clip 0.5 --dp-delta 1e-5 --no-center"  # valid DP options, no statistics


CASES = [
    # ---- extract
    Case(EXTRACT, "--dataset bogus", "'--dataset'"),
    Case(
        "extract --dataset imagefolder --encoder test_efficientnet --no-pretrained --out {out}.h5",
        "",
        "'--data-dir'",
        name="imagefolder without --data-dir",
    ),
    Case(EXTRACT, "--data-dir {missing}", "'--data-dir'"),
    Case(EXTRACT, "--data-dir {file}", "'--data-dir'"),
    Case(EXTRACT, "--data-dir {notimgs}", "'--data-dir'"),
    Case(EXTRACT, "--dataset cifar10 --data-dir {imgs}", "'--data-dir'"),
    Case(EXTRACT, "--dataset mnist --data-dir {imgs}", "'--data-dir'"),
    Case(EXTRACT, "--encoder bogus_model", "'--encoder'"),
    Case(EXTRACT, "--encoder clip:bogus", "'--encoder'"),
    Case(EXTRACT, "--batch-size 0", "'--batch-size'"),
    Case(EXTRACT, "--precision fp8", "'--precision'"),
    Case(EXTRACT, "--dtype int8", "'--dtype'"),
    Case(EXTRACT, "--limit 0", "'--limit'"),
    Case(EXTRACT, "--num-workers -1", "'--num-workers'"),
    Case(EXTRACT, "--device cuda", "'--device'"),
    Case(EXTRACT, "--device tpu", "'--device'"),
    Case(EXTRACT, "--image-size 0", "'--image-size'"),
    Case(EXTRACT, "--image-size -5", "'--image-size'"),
    Case(EXTRACT.replace(" --no-pretrained", ""), "--weights {missing}", "'--weights'"),
    Case(EXTRACT.replace(" --no-pretrained", ""), "--weights {text}", "'--weights'"),
    Case(EXTRACT.replace(" --no-pretrained", ""), "--weights registry", "'--weights'"),
    Case(EXTRACT_ENC, "--data-dir {badimgs}", "unreadable image"),
    Case(EXTRACT_ENC, "--out {file}", "'--out'"),
    Case(EXTRACT_ENC, "--out {storecopy}", "'--out'"),
    Case(EXTRACT_ENC, "--out {full}", "'--out'"),
    Case(EXTRACT_ENC, "--out {under_file}", "'--out'"),
    Case(EXTRACT, "--client-pattern abc", "'--client-pattern'", name="pattern without a group 'client'"),
    Case(EXTRACT, "--client-pattern (?P<client>", "'--client-pattern'", name="pattern not a regex"),
    Case(EXTRACT, "--client-pattern ^zzz(?P<client>.)", "'--client-pattern'", name="pattern matching no file"),
    Case(EXTRACT, "--clients-csv {missing}", "'--clients-csv'"),
    Case(EXTRACT, "--clients-csv {text}", "'--clients-csv'", name="clients CSV without the images' rows"),
    Case(EXTRACT, "--client-folders", "client folders", name="--client-folders on a flat image folder"),
    Case(EXTRACT, "--client-folders --client-pattern (?P<client>.)", "'--client-pattern'", name="two client sources"),
    Case(EXTRACT.replace("imagefolder", "digits"), "--client-pattern (?P<client>.)", "'--client-pattern'"),
    # ---- info
    Case("info", "{missing}", "does not exist"),
    Case("info", "{text}", "not a readable fedhead feature store"),
    Case("info", "{empty}", "not a readable fedhead feature store"),
    Case("info", "{foreign}", "not a fedhead feature store"),
    Case("info", "{partial}", "only partly written"),
    Case("info", "{incomplete}", "never completed"),
    Case("info", "{nosplit}", "split is missing"),
    Case("info", "{newver}", "format version"),
    Case("info", "{floatlabels}", "not integers"),
    Case("info", "{notimgs}", "'STORE'"),
    Case("info", "{nan}", "NaN"),
    Case("info", "{labels}", "outside"),
    Case("info", "", "STORE", name="no STORE argument"),
    # ---- train: the store
    Case(TRAIN, "--partition natural", "'--partition'", name="natural on a store without client ids"),
    Case(TRAIN, "--features {missing}", "does not exist"),
    Case(TRAIN, "--features {notimgs}", "'--features'"),
    Case(TRAIN, "--features {text}", "'--features'"),
    Case(TRAIN, "--features {foreign}", "not a fedhead feature store"),
    Case(TRAIN, "--features {partial}", "only partly written"),
    Case(TRAIN, "--features {incomplete}", "never completed"),
    Case(TRAIN, "--features {nan}", "NaN"),
    Case(TRAIN, "--features {labels}", "outside [0, 10)"),
    Case(TRAIN, "--features {neglabels}", "hold -1"),
    Case(TRAIN, "--features {nosplit}", "split is missing"),
    Case(TRAIN, "--features {newver}", "format version"),
    Case(TRAIN, "--features {floatlabels}", "not integers"),
    # ---- train: unknown names
    Case(TRAIN, "--head bogus", "'--head'"),
    Case(TRAIN, "--partition bogus", "'--partition'"),
    Case(TRAIN, "--partition flwr:Bogus", "flwr-datasets partitioner", name="unknown flwr-datasets partitioner"),
    Case(
        TRAIN,
        "--partition flwr:DirichletPartitioner --partition-arg alpha=1 --partition-arg beta=2",
        "takes: alpha",
        name="flwr partitioner keyword it does not take",
    ),  # fmt: skip
    Case(
        TRAIN,
        "--partition flwr:DirichletPartitioner --partition-arg alpha=[0.1,",
        "does not parse",
        name="flwr partitioner value that does not parse",
    ),  # fmt: skip
    Case(
        TRAIN,
        "--partition flwr:DirichletPartitioner --partition-arg alpha=-1",
        "ValueError",
        name="flwr partitioner raising",
    ),  # fmt: skip
    Case(TRAIN, "--partition iid --partition-arg alpha=0.1", "'--partition-arg'", name="partition-arg without flwr:"),
    Case(TRAIN, "--recipe bogus", "'--recipe'"),
    Case(TRAIN, "--optimizer bogus", "'--optimizer'"),
    Case(TRAIN, "--aggregate bogus", "'--aggregate'"),
    Case(TRAIN, "--scale bogus", "'--scale'"),
    Case(TRAIN, "--noise bogus --noise-rate 0.2", "'--noise'"),
    Case(TRAIN, "--noise asymmetric --noise-rate 0.2 --asym-map bogus", "'--asym-map'"),
    Case(TRAIN, "--noise asymmetric --noise-rate 0.2", "--asym-map cyclic"),
    Case(TRAIN, "--backend bogus", "'--backend'"),
    Case(TRAIN, "--device tpu", "'--device'"),
    Case(TRAIN, "--init bogus", "'--init'"),
    Case(TRAIN, "--server-opt bogus", "'--server-opt'"),
    Case(TRAIN, "--calibrate bogus", "'--calibrate'"),
    # ---- train: numbers out of range
    Case(TRAIN, "--clients 0", "'--clients'"),
    Case(TRAIN, "--clients -3", "'--clients'"),
    Case(TRAIN, "--clients 401", "'--clients'"),
    Case(TRAIN, "--rounds 0", "'--rounds'"),
    Case(TRAIN, "--local-epochs 0", "'--local-epochs'"),
    Case(TRAIN, "--local-steps 0", "'--local-steps'"),
    Case(TRAIN, "--local-steps 5 --local-epochs 2", "'--local-steps'"),
    Case(TRAIN, "--local-steps 2.5", "'--local-steps'"),
    Case(TRAIN, "--batch-size 0", "'--batch-size'"),
    Case(TRAIN, "--lr 0", "'--lr'"),
    Case(TRAIN, "--lr -1", "'--lr'"),
    Case(TRAIN, "--lr nan", "'--lr'"),
    Case(TRAIN, "--lr inf", "'--lr'"),
    Case(TRAIN, "--weight-decay -1", "'--weight-decay'"),
    Case(TRAIN, "--momentum 1", "'--momentum'"),
    Case(TRAIN, "--participation 0", "'--participation'"),
    Case(TRAIN, "--participation 1.5", "'--participation'"),
    Case(TRAIN, "--noise symmetric --noise-rate 1.0", "'--noise-rate'"),
    Case(TRAIN, "--noise-rate -0.1", "'--noise-rate'"),
    Case(TRAIN, "--noise symmetric --noise-rate 0", "'--noise-rate'"),
    Case(TRAIN, "--partition dirichlet --alpha -1", "'--alpha'"),
    Case(TRAIN, "--partition bernoulli-dirichlet --alpha 0", "'--alpha'"),
    Case(TRAIN, "--partition bernoulli-dirichlet --p 1.5", "'--p'"),
    Case(TRAIN, "--partition bernoulli-dirichlet --p 0", "'--p'"),
    Case(TRAIN, "--partition shard --shards-per-client 0", "'--shards-per-client'"),
    Case(TRAIN, "--partition shard --shards-per-client 50 --distinct-labels", "'--shards-per-client'"),
    Case(TRAIN, "--partition zipf --min-size 0", "'--min-size'"),
    Case(TRAIN, "--partition zipf --zipf-s -1", "'--zipf-s'"),
    Case(TRAIN, "--partition dirichlet --min-size 1000", "'--min-size'"),
    Case(TRAIN, "--partition iid --alpha 0.5", "'--alpha'"),
    Case(TRAIN, "--head ova2 --positive-keep 2", "'--positive-keep'"),
    Case(TRAIN, "--head fedabc --focal-gamma -1", "'--focal-gamma'"),
    Case(TRAIN, "--head fedabc --fedabc-margins 1,2", "'--fedabc-margins'"),
    Case(TRAIN, "--head fedabc --fedabc-margins a,b,c", "'a,b,c'"),
    Case(TRAIN, "--head fedrs --fedrs-alpha 2", "'--fedrs-alpha'"),
    Case(TRAIN, "--head fedlc --fedlc-tau -1", "'--fedlc-tau'"),
    Case(TRAIN, "--head ridge --ridge-lambda 0", "'--ridge-lambda'"),
    Case(TRAIN, "--head cof --cof-gamma -1", "'--cof-gamma'"),
    Case(TRAIN, "--head lda --lda-shrinkage -1", "'--lda-shrinkage'"),
    Case(TRAIN, "--head qda --qda-lambda 2", "'--qda-lambda'"),
    Case(TRAIN, "--head qda --qda-gamma -0.5", "'--qda-gamma'"),
    Case(TRAIN, "--head ridge-rf --rf-width 0", "'--rf-width'"),
    Case(TRAIN, "--head ridge-rf --rf-seed -1", "'--rf-seed'"),
    Case(TRAIN, "--head fedpft --fedpft-samples -1", "'--fedpft-samples'"),
    Case(TRAIN, "--head fedpft --fedpft-weight-decay -1", "'--fedpft-weight-decay'"),
    Case(TRAIN, "--init qda", "'--init'", name="--init with a head that is not linear"),
    Case(TRAIN, "--prox-mu -1", "'--prox-mu'"),
    Case(TRAIN, "--server-opt fedadam --server-lr 0", "'--server-lr'"),
    Case(TRAIN, "--server-opt fedavgm --server-momentum 1.5", "'--server-momentum'"),
    Case(TRAIN, "--server-opt fedadam --server-betas 1.5,0.9", "'--server-betas'"),
    Case(TRAIN, "--server-opt fedadam --server-betas x", "'--server-betas'"),
    Case(TRAIN, "--server-opt fedadam --server-betas 0.9", "'--server-betas'"),
    Case(TRAIN, "--server-opt fedadam --server-tau 0", "'--server-tau'"),
    Case(TRAIN, "--init ridge --init-scale 0", "'--init-scale'"),
    Case(TRAIN, "--calibrate ccvr --ccvr-samples 0", "'--ccvr-samples'"),
    Case(TRAIN, "--block-clients -1", "'--block-clients'"),
    Case(TRAIN, "--seeds -1", "'--seeds'"),
    Case(TRAIN, "--seeds x", "'--seeds'"),
    # ---- train: options that do not go together
    Case(TRAIN, "--head ridge --init ridge", "'--init'"),
    Case(TRAIN, "--head ridge --calibrate ccvr", "'--calibrate'"),
    Case(TRAIN, "--head ncm --scaffold", "'--scaffold'"),
    Case(TRAIN, "--head ncm --prox-mu 0.1", "'--prox-mu'"),
    Case(TRAIN, "--head lda --server-opt fedadam", "'--server-opt'"),
    Case(TRAIN, "--recipe fast --head ridge --init ncm", "'--init'"),
    Case(TRAIN, "--head softmax --server-lr 0.1", "'--server-lr'"),
    # ---- train: options given that do not apply (the experiment table's one rule; defaults never trip it)
    Case(TRAIN, "--head ova2 --fedlc-tau 1", "'--fedlc-tau'"),
    Case(TRAIN, "--head softmax --stage1-rounds 2", "'--stage1-rounds'"),
    Case(TRAIN, "--head ova2 --ridge-lambda 1", "'--ridge-lambda'"),
    Case(TRAIN, "--head ridge --rounds 5", "'--rounds'", name="--rounds with a closed-form head"),
    Case(TRAIN, "--head ridge --local-epochs 2", "'--local-epochs'"),
    Case(TRAIN, "--head lda --recipe paper --center", "'--center'"),
    Case(TRAIN, "--partition iid --shards-per-client 2", "'--shards-per-client'"),
    Case(TRAIN, "--partition shard --min-size 2", "'--min-size'"),
    Case(TRAIN, "--partition dirichlet --p 0.5", "'--p'"),
    Case(TRAIN, "--recipe paper --momentum 0.5", "'--momentum'"),
    Case(TRAIN, "--init-scale 2", "'--init-scale'", name="--init-scale without --init"),
    Case(TRAIN, "--noise-rate 0.2", "'--noise-rate'", name="--noise-rate without --noise"),
    Case(TRAIN, "--noise symmetric --noise-rate 0.2 --asym-map cyclic", "'--asym-map'"),
    Case(TRAIN, "--noise symmetric --noise-rate 0.2 --noise-dataset cifar10", "'--noise-dataset'"),
    Case(TRAIN, "--ccvr-samples 10", "'--ccvr-samples'", name="--ccvr-samples without --calibrate ccvr"),
    Case(TRAIN, "--server-opt fedadam --server-momentum 0.9", "'--server-momentum'"),
    Case(TRAIN, "--server-opt fedadagrad --server-betas 0.9,0.99", "'--server-betas'"),
    Case(TRAIN, "--secure-aggregation", "'--secure-aggregation'", name="--secure-aggregation (Flower only)"),
    # ---- train: the experiment file
    Case(TRAIN, "--config {missing}", "'--config'"),
    Case(TRAIN, "--config {text}", "'--config'", name="--config <not TOML>"),
    # ---- train: differential privacy (DP = noise, clip and delta, no statistics)
    Case(TRAIN, "--dp-noise-multiplier 1 --dp-delta 1e-5", "'--dp-clip'", name="DP noise without --dp-clip"),
    Case(TRAIN, "--dp-noise-multiplier 1 --dp-clip 0.5", "'--dp-delta'", name="DP noise without --dp-delta"),
    Case(TRAIN, "--dp-clip 0.5", "'--dp-clip'", name="--dp-clip without --dp-noise-multiplier"),
    Case(TRAIN, "--dp-delta 1e-5", "'--dp-delta'", name="--dp-delta without --dp-noise-multiplier"),
    Case(TRAIN, "--dp-feature-clip 1", "'--dp-feature-clip'", name="--dp-feature-clip without DP"),
    Case(TRAIN, "--aggregate dp-fedavg", "'--aggregate'", name="--aggregate dp-fedavg without DP"),
    Case(TRAIN, DP + " --dp-noise-multiplier -1", "'--dp-noise-multiplier'"),
    Case(TRAIN, DP + " --dp-clip 0", "'--dp-clip'"),
    Case(TRAIN, DP + " --dp-clip -0.5", "'--dp-clip'"),
    Case(TRAIN, DP + " --dp-delta 0", "'--dp-delta'"),
    Case(TRAIN, DP + " --dp-delta 1", "'--dp-delta'"),
    Case(TRAIN, DP + " --dp-delta 1.5", "'--dp-delta'"),
    Case(TRAIN, DP + " --aggregate grouped", "'--aggregate'"),
    Case(TRAIN, DP + " --scaffold", "'--scaffold'"),
    Case(TRAIN, DP + " --calibrate ccvr", "'--calibrate'"),
    Case(TRAIN, DP + " --aggregate fedavg-int8", "'--aggregate'"),
    Case(TRAIN, "--aggregate fedavg-topk --topk-fraction 0", "'--topk-fraction'"),
    Case(TRAIN, "--aggregate fedavg-topk --topk-fraction 1.5", "'--topk-fraction'"),
    Case(TRAIN, "--topk-fraction 0.1", "'--topk-fraction'", name="--topk-fraction without fedavg-topk"),
    Case(TRAIN, "--aggregate fedavg-int8 --topk-fraction 0.1", "'--topk-fraction'"),
    Case(TRAIN, "--no-error-feedback", "'--error-feedback'", name="--no-error-feedback without compression"),
    Case(TRAIN, "--head ridge --aggregate fedavg-int8", "'--aggregate'"),
    Case(TRAIN, DP + " --head cof", "'--head'"),
    Case(TRAIN, DP + " --head qda", "second moments"),
    Case(TRAIN, DP + " --init cof --dp-feature-clip 1", "'--init'"),
    Case(TRAIN, DP + " --center", "'--dp-feature-clip'", name="DP with --center, no --dp-feature-clip"),
    Case(TRAIN, DP + " --init ridge", "'--dp-feature-clip'", name="DP with --init, no --dp-feature-clip"),
    Case(TRAIN, DP + " --center --dp-feature-clip 0", "'--dp-feature-clip'"),
    Case(TRAIN, DP + " --dp-feature-clip 1", "'--dp-feature-clip'", name="--dp-feature-clip, no statistics"),
    Case(
        TRAIN,
        DP + " --head ridge --dp-feature-clip 1",
        "'--dp-feature-clip'",
        name="--dp-feature-clip with a closed-form head",
    ),
    # ---- train: device, resume, --out
    Case(TRAIN, "--device cuda", "'--device'"),
    Case(TRAIN, "--device cuda:0", "'--device'"),
    Case(TRAIN, "--resume", "'--resume'", name="--resume --out <no run there>"),
    Case("train --features {store} --clients 10 --rounds 1", "--resume", "'--resume'", name="--resume without --out"),
    Case(TRAIN, "--out {full}", "'--out'"),
    Case(TRAIN, "--out {file}", "'--out'"),
    Case(TRAIN, "--out {under_file}", "'--out'"),
    # ---- synth
    Case(SYNTH, "--natural-clients -1", "'--natural-clients'"),
    Case(SYNTH, "--natural-clients 5", "'--natural-clients'", name="more natural clients than samples"),
    Case(SYNTH, "--num-classes 1", "'--num-classes'"),
    Case(SYNTH, "--num-classes 0", "'--num-classes'"),
    Case(SYNTH, "--train-per-class 0", "'--train-per-class'"),
    Case(SYNTH, "--test-per-class 0", "'--test-per-class'"),
    Case(SYNTH, "--dim 0", "'--dim'"),
    Case(SYNTH, "--dim -1", "'--dim'"),
    Case(SYNTH, "--spread 0", "'--spread'"),
    Case(SYNTH, "--spread -1", "'--spread'"),
    Case(SYNTH, "--spread nan", "'--spread'"),
    Case(SYNTH, "--spread inf", "'--spread'"),
    Case(SYNTH, "--seed -1", "'--seed'"),
    Case(SYNTH, "--num-classes x", "'--num-classes'"),
    Case(SYNTH, "--out {full}", "'--out'"),
    Case(SYNTH, "--out {file}", "'--out'"),
    Case(SYNTH, "--out {storecopy}", "'--out'"),
    Case(SYNTH, "--out {under_file}", "'--out'"),
    # ---- demo
    Case(DEMO, "--device cuda", "'--device'"),
    Case(DEMO, "--device tpu", "'--device'"),
    Case(DEMO, "--image-size 0", "'--image-size'"),
    Case(DEMO, "--clients 0", "'--clients'", fake="demo"),
    Case(DEMO, "--rounds 0", "'--rounds'", fake="demo"),
    # ---- scratch
    Case("scratch bogus --dataset imagefolder --data-dir {imgs} --out {out}", "", "'ALGO'", name="ALGO bogus"),
    Case(SCRATCH, "--dataset bogus", "'--dataset'"),
    Case(SCRATCH, "--model bogus", "'--model'"),
    Case(SCRATCH, "--partition bogus", "'--partition'"),
    Case(SCRATCH, "--partition natural", "'--partition'", name="natural on images without clients"),
    Case(SCRATCH, "--optimizer bogus", "'--optimizer'"),
    Case(SCRATCH, "--backend bogus", "'--backend'"),
    Case(DNC, "--divergence bogus", "'--divergence'"),
    Case(SCRATCH, "--device cuda", "'--device'"),
    Case(SCRATCH, "--device tpu", "'--device'"),
    Case(SCRATCH, "--noise bogus --noise-rate 0.2", "'--noise'"),
    Case(SCRATCH, "--noise symmetric --noise-rate 1.0", "'--noise-rate'"),
    Case(SCRATCH, "--noise-rate 1.5", "'--noise-rate'"),
    Case(SCRATCH, "--noise symmetric --noise-rate 0", "'--noise-rate'"),
    Case(SCRATCH, "--clients 0", "'--clients'"),
    Case(SCRATCH, "--clients 100", "'--clients'"),
    Case(SCRATCH, "--participation 0", "'--participation'"),
    Case(SCRATCH, "--participation 1.5", "'--participation'"),
    Case(SCRATCH, "--rounds 0", "'--rounds'"),
    Case(SCRATCH, "--local-epochs 0", "'--local-epochs'"),
    Case(SCRATCH, "--batch-size 0", "'--batch-size'"),
    Case(SCRATCH, "--lr 0", "'--lr'"),
    Case(SCRATCH, "--lr inf", "'--lr'"),
    Case(SCRATCH, "--momentum 1", "'--momentum'"),
    Case(SCRATCH, "--weight-decay -1", "'--weight-decay'"),
    Case(SCRATCH, "--seeds -1", "'--seeds'"),
    Case(SCRATCH, "--subset 0", "'--subset'"),
    Case(SCRATCH, "--test-subset 0", "'--test-subset'"),
    Case(SCRATCH, "--max-samples-per-client 0", "'--max-samples-per-client'"),
    Case(SCRATCH, "--local-test-size -1", "'--local-test-size'"),
    Case(DNC, "--prepass-rounds -1", "'--prepass-rounds'"),
    Case(DNC, "--split-threshold 2", "'--split-threshold'"),
    Case(DNC, "--feature-epochs 0", "'--feature-epochs'"),
    Case(DNC, "--finetune-epochs 0", "'--finetune-epochs'"),
    Case(DNC, "--split-layer 0", "'--split-layer'"),
    Case(DNC, "--lr-decay 0", "'--lr-decay'"),
    Case(DNC, "--finetune-lr-factor -1", "'--finetune-lr-factor'"),
    Case(SCRATCH, "--partition dirichlet --alpha 0", "'--alpha'"),
    Case(SCRATCH, "--partition shard --shards-per-client 0", "'--shards-per-client'"),
    Case(SCRATCH, "--partition shard --shards-per-client 5 --distinct-labels", "'--shards-per-client'"),
    Case(SCRATCH, "--partition color-skew --clients 3", "'--clients'"),
    Case(SCRATCH, "--partition color-skew --skew 2", "'--skew'"),
    Case(SCRATCH, "--model kws-cnn", "'--model'"),
    Case(SCRATCH, "--data-dir {missing}", "'--data-dir'"),
    Case(SCRATCH, "--data-dir {file}", "'--data-dir'"),
    Case(SCRATCH, "--dataset mnist", "'--data-dir'"),
    Case(SCRATCH, "--dataset speech-commands", "'--data-dir'"),
    Case(SCRATCH, "--resume", "'--resume'", name="--resume --out <no run there>"),
    Case(
        "scratch fedavg --dataset imagefolder --data-dir {imgs} --clients 2 --rounds 1",
        "--resume",
        "'--resume'",
        name="--resume without --out",
    ),
    Case(SCRATCH, "--out {file}", "'--out'"),
    Case(SCRATCH, "--out {full}", "'--out'"),
    Case(SCRATCH, "--out {under_file}", "'--out'"),
    Case(SCRATCH, "--share-fraction -0.1", "'--share-fraction'"),
    Case(SCRATCH, "--share-fraction 1.5", "'--share-fraction'"),
    Case(SCRATCH, "--share-fraction nan", "'--share-fraction'"),
    Case(SCRATCH, "--share-fraction 0.01", "'--share-fraction'", name="--share-fraction 0.01 (empty shared set)"),
    Case(FEDPROX, "--prox-mu -1", "'--prox-mu'"),
    Case(FEDPROX, "--prox-mu inf", "'--prox-mu'"),
    Case(SCRATCH, "--prox-mu 0.1", "'--prox-mu'", name="--prox-mu with fedavg"),
    Case(FEDPER, "--head-layers 0", "'--head-layers'"),
    Case(FEDPER, "--head-layers 3", "'--head-layers'", name="--head-layers 3 (cnn has 3 weight layers)"),
    Case(FEDROD, "--head-layers 1", "'--head-layers'", name="--head-layers with fedrod"),
    Case(FEDREP, "--body-epochs 0", "'--body-epochs'"),
    Case(FEDREP, "--local-epochs 2 --body-epochs 2", "'--body-epochs'"),
    Case(SCAFFOLD, "--optimizer adam", "'--optimizer'", name="scaffold --optimizer adam"),
    # ---- bench ablation
    Case(ABLATION, "--head bogus", "'--head'"),
    Case(ABLATION, "--partition bogus", "'--partition'"),
    Case(ABLATION, "--recipe bogus", "'--recipe'"),
    Case(ABLATION, "--seeds x", "'--seeds'"),
    Case(ABLATION, "--seeds -1", "'--seeds'"),
    Case(ABLATION, "--rounds 0", "'--rounds'"),
    Case(ABLATION, "--clients 0", "'--clients'"),
    Case(ABLATION, "--clients 401", "'--clients'"),
    Case(ABLATION, "--lr 0", "'--lr'"),
    Case(ABLATION, "--batch-size 0", "'--batch-size'"),
    Case(ABLATION, "--local-epochs 0", "'--local-epochs'"),
    Case(ABLATION, "--optimizer bogus", "'--optimizer'"),
    Case(ABLATION, "--init bogus", "'--init'"),
    Case(ABLATION, "--prox-mu -1", "'--prox-mu'"),
    Case(ABLATION, "--local-steps 0", "'--local-steps'"),
    Case(ABLATION, "--server-opt fedadam --server-betas 1.5,0.9", "'--server-betas'"),
    # --init reaches only the runs of an iterative head (a grid passes each run what applies to it): refused when
    # no head of the grid takes it
    Case(ABLATION.replace(" --head ova2", ""), "--head ncm --init ridge", "'--init'"),
    Case(ABLATION, "--features {missing}", "does not exist"),
    Case(ABLATION, "--features {nan}", "NaN"),
    Case(ABLATION, "--device cuda", "'--device'"),
    Case(ABLATION, "--block-clients -1", "'--block-clients'"),
    Case(ABLATION, "--out {file}", "'--out'"),
    Case(ABLATION, "--out {under_file}", "'--out'"),
    Case(ABLATION.replace(" --head ova2", ""), "--head softmax --stage1-rounds 2", "'--stage1-rounds'"),
    Case(ABLATION, "--head ''", "'--head'"),
    # ---- bench partitions
    Case(PARTITIONS, "--partition bogus", "'--partition'"),
    Case(PARTITIONS, "--head bogus", "'--head'"),
    Case(PARTITIONS, "--recipe fast", "'--recipe'"),
    Case(PARTITIONS, "--features {foreign}", "not a fedhead feature store"),
    Case(PARTITIONS, "--head ridge --ridge-lambda 0", "'--ridge-lambda'"),
    Case(PARTITIONS, "--scale bogus", "'--scale'"),
    Case(PARTITIONS, "--aggregate bogus", "'--aggregate'"),
    Case(PARTITIONS, "--calibrate bogus", "'--calibrate'"),
    Case(PARTITIONS, "--device cuda", "'--device'"),
    # ---- bench encoders
    Case(ENCODERS, "--features {other}", "same dataset"),
    Case(ENCODERS, "--features {missing}", "does not exist"),
    Case(ENCODERS, "--features {text}", "'--features'"),
    Case(ENCODERS, "--head bogus", "'--head'"),
    Case(ENCODERS, "--partition bogus", "'--partition'"),
    Case(ENCODERS, "--recipe bogus", "'--recipe'"),
    Case(ENCODERS, "--seeds x", "'--seeds'"),
    # ---- bench noise
    Case(NOISE, "--sym-rates 1.0", "'--sym-rates'"),
    Case(NOISE, "--sym-rates -0.1", "'--sym-rates'"),
    Case(NOISE, "--sym-rates x", "'--sym-rates'"),
    Case(NOISE, "--sym-rates ''", "both empty"),
    Case(NOISE, "--sym-rates 0", "'--sym-rates'"),
    Case(NOISE, "--asym-rates 0.2 --asym-map bogus", "'--asym-map'"),
    Case(NOISE, "--asym-rates 0.2", "--asym-map cyclic"),
    Case(NOISE, "--partition bogus", "'--partition'"),
    Case(NOISE, "--head bogus", "'--head'"),
    Case(NOISE, "--recipe bogus", "'--recipe'"),
    Case(NOISE, "--device cuda", "'--device'"),
    # ---- bench participation
    Case(PARTICIPATION, "--rates 0", "'--rates'"),
    Case(PARTICIPATION, "--rates 1.5", "'--rates'"),
    Case(PARTICIPATION, "--rates x", "'--rates'"),
    Case(PARTICIPATION, "--rates ''", "'--rates'"),
    Case(PARTICIPATION, "--partition bogus", "'--partition'"),
    Case(PARTICIPATION, "--head bogus", "'--head'"),
    Case(PARTICIPATION, "--recipe bogus", "'--recipe'"),
    Case(PARTICIPATION, "--seeds -1", "'--seeds'"),
    # ---- bench geometry
    Case(GEOMETRY, "--split bogus", "'--split'"),
    Case(GEOMETRY, "--samples-per-class -1", "'--samples-per-class'"),
    Case(GEOMETRY, "--seeds x", "'--seeds'"),
    Case(GEOMETRY, "--features {missing}", "does not exist"),
    Case(GEOMETRY, "--features {nan}", "NaN"),
    Case(GEOMETRY, "--features {text}", "'--features'"),
    Case(GEOMETRY, "--features {labels}", "outside"),
    Case(GEOMETRY, "--out {file}", "'--out'"),
    Case(GEOMETRY, "--out {under_file}", "'--out'"),
    Case(OPENSET, "--known-fraction 1", "'--known-fraction'"),
    Case(OPENSET, "--known-fraction 0.01", "'--known-fraction'", name="--known-fraction leaving no known class"),
    Case(OPENSET, "--heads nope", "'--heads'"),
    Case(OPENSET, "--partitions natural", "'--partitions'"),
    Case(OPENSET, "--clients 0", "'--clients'"),
    Case(OPENSET, "--out {file}", "'--out'"),
    # ---- bench speed (measurement stand-in)
    Case(SPEED, "--rounds 0", "'--rounds'"),
    Case(SPEED, "--loop-rounds -1", "'--loop-rounds'"),
    Case(SPEED, "--threads 0", "'--threads'"),
    Case(SPEED, "--ceiling-rounds 0", "'--ceiling-rounds'"),
    Case(SPEED, "--ceiling-method lda", "'--ceiling-method'"),
    Case(SPEED, "--ceiling-store {file}", "'--ceiling-store'"),
    Case(SPEED, "--device cuda", "'--device'"),
    Case(SPEED, "--device tpu", "'--device'"),
    Case(SPEED, "--out {full}", "'--out'"),
    Case(SPEED, "--out {under_file}", "'--out'"),
    # ---- bench extract
    Case(BENCH_EXTRACT, "--num-images 0", "'--num-images'"),
    Case(BENCH_EXTRACT, "--repeats 0", "'--repeats'"),
    Case(BENCH_EXTRACT, "--dataset bogus", "'--dataset'"),
    Case(BENCH_EXTRACT, "--data-dir {missing}", "'--data-dir'"),
    Case(
        "bench extract --dataset imagefolder --encoder test_efficientnet --out {out}.json",
        "",
        "'--data-dir'",
        name="imagefolder without --data-dir",
    ),
    Case(BENCH_EXTRACT, "--encoder bogus_model", "'--encoder'"),
    Case(BENCH_EXTRACT, "--device cuda", "'--device'"),
    Case(BENCH_EXTRACT, "--batch-size 0", "'--batch-size'"),
    Case(BENCH_EXTRACT, "--precision fp8", "'--precision'"),
    Case(BENCH_EXTRACT, "--image-size 0", "'--image-size'"),
    Case(BENCH_EXTRACT, "--num-workers -1", "'--num-workers'"),
    Case(BENCH_EXTRACT, "--out {full}", "'--out'"),
    Case(BENCH_EXTRACT, "--out {under_file}", "'--out'"),
    # ---- bench flower
    Case(DEPLOY, "--nodes 1", "'--nodes'"),
    Case(DEPLOY, "--rounds 1", "'--rounds'"),
    Case(DEPLOY, "--churn 1", "'--churn'"),
    Case(DEPLOY, "--kill-server-at 3", "'--kill-server-at'"),
    Case(DEPLOY, "--round-timeout 0", "'--round-timeout'"),
    Case(DEPLOY, "--slow 0.5", "'--slow'", name="--slow without --async"),
    Case(DEPLOY, "--async --churn 0.1", "'--churn'", name="--async with --churn"),
    Case(DEPLOY, "--async --slow 1", "'--slow'"),
    Case(DEPLOY, "--async --slow-delay 60 --round-timeout 60", "'--slow-delay'"),
    Case(DEPLOY, "--async --buffer 4", "'--buffer'"),
    Case(DEPLOY, "--out {full}", "'--out'"),
    Case(DEPLOY, "--out {file}", "'--out'"),
    Case(BENCH_FLOWER, "--out {full}", "'--out'"),
    Case(BENCH_FLOWER, "--clients 0", "'--clients'"),
    Case(BENCH_FLOWER, "--rounds 0", "'--rounds'"),
    Case(BENCH_FLOWER, "--num-classes 1", "'--num-classes'"),
    Case(BENCH_FLOWER, "--train-per-class 0", "'--train-per-class'"),
    Case(BENCH_FLOWER, "--dim 0", "'--dim'"),
    Case(BENCH_FLOWER, "--head bogus", "'--head'"),
    Case(BENCH_FLOWER, "--partition bogus", "'--partition'"),
    Case(BENCH_FLOWER, "--local-epochs 0", "'--local-epochs'"),
    Case(BENCH_FLOWER, "--batch-size 0", "'--batch-size'"),
    Case(BENCH_FLOWER, "--out {file}", "'--out'"),
    # ---- bench baselines
    Case(BASELINES, "--methods bogus", "'--methods'"),
    Case(BASELINES, "--methods ''", "'--methods'"),
    Case(BASELINES, "--partition bogus", "'--partition'"),
    Case(BASELINES, "--partition ''", "'--partition'"),
    Case(BASELINES, "--partition dirichlet-0", "'--alpha'"),
    Case(BASELINES, "--partition dirichlet-x", "'--partition'"),
    Case(BASELINES, "--recipe bogus", "'--recipe'"),
    Case(BASELINES, "--methods ncm --init ridge", "'--init'"),
    Case(BASELINES, "--methods ridge --ridge-lambda 0", "'--ridge-lambda'"),
    Case(BASELINES, "--methods ridge --sketch-dims 0", "'--sketch-dims'"),
    Case(BASELINES, "--methods ridge --sketch-dims a,b", "'--sketch-dims'"),
    Case(BASELINES, "--methods ncm --sketch-dims 4", "'--sketch-dims'", name="--sketch-dims, no sketched method"),
    Case(TRAIN, "--head ridge --stats-sketch -1", "'--stats-sketch'"),
    Case(TRAIN, "--head cof --stats-sketch 4", "'--stats-sketch'", name="--stats-sketch with cof"),
    Case(TRAIN, "--personalize bogus", "'--personalize'"),
    Case(TRAIN, "--personalize fedrep", "hidden layer", name="--personalize needing a hidden layer"),
    Case(TRAIN, "--personalize fedrod", "--head bsm", name="--personalize fedrod without its generic head"),
    Case(TRAIN, "--personalize closed-form", "'--personalize'", name="--personalize closed-form, no statistics"),
    Case(TRAIN, "--head ridge --personalize prior", "log-probabilities", name="--personalize prior on ridge"),
    Case(TRAIN, "--head qda --personalize finetune", "not linear", name="--personalize finetune on qda"),
    Case(TRAIN, "--head ridge --personalize closed-form --personal-beta 0", "'--personal-beta'"),
    Case(TRAIN, "--personalize ditto --personal-lambda -1", "'--personal-lambda'"),
    Case(TRAIN, "--personalize finetune --personal-epochs -1", "'--personal-epochs'"),
    Case(TRAIN, "--personal-epochs 3", "'--personal-epochs'", name="--personal-epochs without --personalize"),
    Case(BASELINES, "--clients 0", "'--clients'"),
    Case(BASELINES, "--dp-noise-multiplier 1 --dp-delta 1e-5", "'--dp-clip'", name="DP noise without --dp-clip"),
    Case(BASELINES, "--seeds x", "'--seeds'"),
    Case(BASELINES, "--ridge-lambda 1", "'--ridge-lambda'", name="--ridge-lambda, no method uses ridge"),
    Case(BASELINES, "--server-momentum 0.9", "'--server-momentum'", name="--server-momentum, no method's server"),
    Case(BASELINES, "--features {missing}", "does not exist"),
    Case(PRIVACY, "--methods fedlc", "'--methods'"),
    Case(PRIVACY, "--epsilons 0", "'--epsilons'"),
    Case(PRIVACY, "--epsilons x", "'--epsilons'"),
    Case(PRIVACY, "--epsilons 1e-9", "'--epsilons'", name="epsilon out of the accountant's reach"),
    Case(PRIVACY, "--dp-delta 1", "'--dp-delta'"),
    Case(PRIVACY, "--update-clip 0", "'--update-clip'"),
    Case(PRIVACY, "--feature-clip -1", "'--feature-clip'"),
    Case(PRIVACY, "--dp-clip 1", "'--dp-clip'", name="DP options are the bench's own"),
    Case(PRIVACY, "--partition bogus", "'--partition'"),
    Case(PRIVACY, "--secagg-clients 2", "'--secagg-clients'"),
    Case(PRIVACY, "--secagg-rounds 0", "'--secagg-rounds'"),
    # ---- bench papers
    Case(PAPERS.replace(" dnc ", " bogus "), "", "'PAPER'", name="PAPER bogus"),
    Case(PAPERS, "--scale gpu", "'--scale'"),
    Case("bench papers dnc --quick --out {out}", "", "'--data-dir'", name="--data-dir missing"),
    Case(PAPERS, "--data-dir {missing}", "'--data-dir'"),
    Case(PAPERS, "--data-dir {notimgs}", "'--data-dir'", name="--data-dir <none of the paper's datasets>"),
    Case(
        PAPERS.replace(" dnc ", " fedova "),
        "",
        "'--data-dir'",
        name="fedova, --data-dir <only a column --scale cpu leaves out>",
    ),
    Case(
        PAPERS.replace(" dnc ", " fedova "), "--datasets mnist", "'--data-dir'", name="--datasets <not in --data-dir>"
    ),
    Case(PAPERS, "--datasets mnist", "'--datasets'", name="--datasets <not the paper's>"),
    Case(PAPERS, "--datasets ''", "'--datasets'"),
    Case(PAPERS, "--alphas 0.1", "'--alphas'", name="--alphas with dnc"),
    Case(PAPERS.replace(" dnc ", " fedabc ") + " --datasets cifar10", "--alphas 0", "'--alphas'"),
    Case(
        PAPERS.replace(" dnc ", " fedabc ") + " --datasets cifar10",
        "",
        "'--min-size'",
        name="fedabc on 8 images: one run's check fails before any run starts",
    ),
    Case(PAPERS, "--seeds x", "'--seeds'"),
    Case(PAPERS, "--backend bogus", "'--backend'"),
    Case(PAPERS, "--device cuda", "'--device'"),
    Case(PAPERS, "--out {file}", "'--out'"),
    Case(PAPERS, "--out {under_file}", "'--out'"),
    # ---- flower simulate (Flower's run_simulation stand-in; must not be reached)
    Case(SIMULATE, "--clients 0", "'--clients'"),
    Case(SIMULATE, "--partition natural", "'--partition'", name="natural on a store without client ids"),
    Case(SIMULATE, "--rounds 0", "'--rounds'"),
    Case(SIMULATE, "--participation 1.5", "'--participation'"),
    Case(SIMULATE, "--noise symmetric --noise-rate 1.0", "'--noise-rate'"),
    Case(SIMULATE, "--recipe bogus", "'--recipe'"),
    Case(SIMULATE, "--lr 0", "'--lr'"),
    Case(SIMULATE, "--seeds -1", "'--seeds'"),
    Case(SIMULATE, "--prox-mu -1", "'--prox-mu'"),
    Case(SIMULATE, "--local-steps -3", "'--local-steps'"),
    Case(SIMULATE, "--central-reference", "'--central-reference'"),
    Case(SIMULATE, "--features {missing}", "does not exist"),
    Case(SIMULATE, "--features {foreign}", "not a fedhead feature store"),
    Case(
        "flower simulate --features {store} --clients 2 --rounds 1",
        "--resume",
        "'--resume'",
        name="--resume without --out",
    ),
    Case(SIMULATE, "--scaffold --optimizer adamw", "'--scaffold'"),
    Case(SIMULATE, "--calibrate ccvr --ccvr-samples 0", "'--ccvr-samples'"),
    Case(SIMULATE, "--head ridge --calibrate ccvr", "'--calibrate'"),
    Case(SIMULATE, "--head bogus", "'--head'"),
    Case(SIMULATE, "--partition bogus", "'--partition'"),
    Case(SIMULATE, "--partition dirichlet --alpha 0", "'--alpha'"),
    Case(SIMULATE, "--device cuda", "'--device'"),
    Case(SIMULATE, "--server-opt bogus", "'--server-opt'"),
    Case(SIMULATE, "--server-opt fedadam --server-betas 1.5,0.9", "'--server-betas'"),
    Case(SIMULATE, "--head ridge --init ridge", "'--init'"),
    Case(SIMULATE, "--head fedabc --fedabc-margins 1,2", "'--fedabc-margins'"),
    Case(SIMULATE, "--dp-noise-multiplier 1 --dp-clip 0.5", "'--dp-delta'", name="DP noise without --dp-delta"),
    Case(SIMULATE, DP + " --dp-delta 1", "'--dp-delta'"),
    Case(SIMULATE, DP + " --scaffold", "'--scaffold'"),
    Case(
        SIMULATE,
        "--clients 3 --secure-aggregation --aggregate fedavg-topk",
        "'--aggregate'",
        name="--secure-aggregation with a compressed rule",
    ),
    Case(SIMULATE, "--features {nan}", "NaN"),
    Case(SIMULATE, "--clients 401", "'--clients'"),
    Case(SIMULATE, "--backend bogus", "'--backend'"),
    Case(SIMULATE, "--secure-aggregation", "'--secure-aggregation'", name="--secure-aggregation with 2 clients"),
    Case(
        SIMULATE,
        "--clients 10 --participation 0.2 --secure-aggregation",
        "'--secure-aggregation'",
        name="--secure-aggregation with 2 clients a round",
    ),
    Case(SIMULATE, "--round-timeout 0", "'--round-timeout'"),
    Case(SIMULATE, "--client-cpus 0", "'--client-cpus'"),
    Case(SIMULATE, "--num-cpus -1", "'--num-cpus'"),
    Case(SIMULATE, "--out {full}", "already holds files"),
    Case(SIMULATE, "--resume", "resume", name="--resume --out <no run there>"),
    Case(SIMULATE, "--out {under_file}", "'--out'"),
    Case(SIMULATE, "--iid-reference", "'--iid-reference'", name="--iid-reference (fedhead train only)"),
    Case(SIMULATE, "--block-clients 2", "'--block-clients'", name="--block-clients (fedhead train only)"),
    Case(SIMULATE, "--head ova2 --fedlc-tau 1", "'--fedlc-tau'"),
    Case(SIMULATE, "--head ridge --rounds 5", "'--rounds'", name="--rounds with a closed-form head"),
    Case(SIMULATE, "--config {missing}", "'--config'"),
]

_ids = [c.id for c in CASES]
assert len(_ids) == len(set(_ids)), sorted({i for i in _ids if _ids.count(i) > 1})


def _param(c: Case):
    marks = [pytest.mark.xfail(strict=True, reason=c.bug)] if c.bug else []
    return pytest.param(c, id=c.id, marks=marks)


# ---------------------------------------------------------------- inputs


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> dict[str, str]:
    """Read-only inputs shared by every case: a tiny store, broken stores, tiny image folders, odd files."""
    import h5py
    from PIL import Image

    from fedhead.core.synthetic import write_synthetic

    d = tmp_path_factory.mktemp("bad-inputs")
    store = write_synthetic(
        d / "tiny.h5", num_classes=10, train_per_class=40, test_per_class=10, dim=16, latent=8, spread=1.0, seed=0
    )
    other = write_synthetic(
        d / "other.h5", num_classes=12, train_per_class=20, test_per_class=5, dim=16, latent=8, spread=1.0, seed=2
    )

    def broken(name: str, edit) -> str:
        p = d / f"{name}.h5"
        shutil.copy(store, p)
        with h5py.File(p, "r+") as f:
            edit(f)
        return str(p)

    def set_row(key, row, value):
        def edit(f):
            a = f[key][()]
            a[row] = value
            f[key][...] = a

        return edit

    def float_labels(f):
        y = f["train/labels"][()]
        del f["train/labels"]
        f["train/labels"] = y.astype("float32")

    paths = {
        "store": str(store),
        "other": str(other),
        "nan": broken("nan", set_row("train/features", (3, 2), np.nan)),
        "labels": broken("labels", set_row("test/labels", 5, 10)),  # 10 classes: 10 is out of range
        "neglabels": broken("neglabels", set_row("train/labels", 0, -1)),
        "nosplit": broken("nosplit", lambda f: f.__delitem__("test")),
        "newver": broken("newver", lambda f: f.attrs.__setitem__("format_version", 99)),
        "floatlabels": broken("floatlabels", float_labels),
        "missing": str(d / "missing.h5"),
    }
    with h5py.File(d / "foreign.h5", "w") as f:  # HDF5, but not a fedhead store
        f["x"] = np.zeros(3)
    with h5py.File(d / "incomplete.h5", "w") as f:
        f.attrs["format"] = "fedhead-features"
        f.attrs["complete"] = False
    (d / "text.h5").write_text("not an HDF5 file\n")
    (d / "empty.h5").write_bytes(b"")
    shutil.copy(store, d / "partial.h5.partial")  # only the .partial exists
    paths.update(
        foreign=str(d / "foreign.h5"),
        incomplete=str(d / "incomplete.h5"),
        text=str(d / "text.h5"),
        empty=str(d / "empty.h5"),
        partial=str(d / "partial.h5"),
    )

    rng = np.random.default_rng(0)
    imgs = d / "imgs"  # 2 classes, 8 train / 4 test images
    for split, n in (("train", 4), ("test", 2)):
        for c in ("cat", "dog"):
            (imgs / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(imgs / split / c / f"{i}.png")
    badimgs = d / "badimgs"
    shutil.copytree(imgs, badimgs)
    (badimgs / "train" / "cat" / "0.png").write_text("not an image\n")
    notimgs = d / "notimgs"  # a folder without the layout
    notimgs.mkdir()
    (notimgs / "readme.txt").write_text("no train/ or test/ here\n")
    paths.update(imgs=str(imgs), badimgs=str(badimgs), notimgs=str(notimgs))
    return paths


@pytest.fixture(autouse=True)
def _env(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("FEDHEAD_NO_PROGRESS", "1")
    monkeypatch.setenv("FEDHEAD_THREADS", "1")
    monkeypatch.setenv("FEDHEAD_CACHE", str(tmp_path_factory.getbasetemp() / "scratch-cache"))
    monkeypatch.setenv("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # flower simulate sets it; restore it
    monkeypatch.delenv("FEDHEAD_DEBUG", raising=False)
    monkeypatch.delenv("FEDHEAD_PLUGINS", raising=False)


def _case_paths(tmp_path: Path, inputs: dict) -> dict[str, str]:
    """Per case: the output name, an existing regular file, a folder holding a file, a copy of the store."""
    (tmp_path / "afile.h5").write_bytes(b"a file the command must leave alone\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep me\n")
    shutil.copy(inputs["store"], tmp_path / "store-copy.h5")
    return {
        **inputs,
        "out": str(tmp_path / "out"),
        "file": str(tmp_path / "afile.h5"),
        "full": str(tmp_path / "full"),
        "storecopy": str(tmp_path / "store-copy.h5"),
        "under_file": str(tmp_path / "afile.h5" / "sub"),
    }


def _snapshot(p: Path):
    """What is at ``p``: None, a file's hash, or a folder's relative paths and file hashes."""

    def digest(f: Path) -> str:
        return hashlib.sha256(f.read_bytes()).hexdigest()

    try:
        if p.is_symlink() or p.is_file():
            return ("file", digest(p))
        if p.is_dir():
            return ("dir", {str(q.relative_to(p)): digest(q) if q.is_file() else "dir" for q in sorted(p.rglob("*"))})
    except OSError:
        pass
    return None


def _out_of(argv: list[str]) -> Path | None:
    """The value of the last ``--out`` in ``argv``."""
    idx = [i for i, a in enumerate(argv) if a == "--out"]
    return Path(argv[idx[-1] + 1]) if idx else None


# ---------------------------------------------------------------- stand-ins for slow machinery


class _NoGrid:
    """A Flower grid that refuses any use: reaching it means the configuration passed every check."""

    def __getattr__(self, name):
        raise RuntimeError("stand-in Flower grid: the configuration passed validation, the rounds would start here")


def _fake_flower(monkeypatch) -> list:
    sim = pytest.importorskip("flwr.simulation")
    calls: list = []

    def run_simulation(server_app, client_app, num_supernodes, backend_config=None, **kw):
        calls.append(num_supernodes)
        main = getattr(server_app, "_main", None)
        if main is None:
            raise RuntimeError("stand-in run_simulation: cannot reach the ServerApp's main")
        main(_NoGrid(), None)

    monkeypatch.setattr(sim, "run_simulation", run_simulation)
    return calls


def _fake_demo_extraction(monkeypatch) -> None:
    import extract.run

    def extract_features(dataset, data_dir, encoder, *, out, **kw):
        from fedhead.core.synthetic import write_synthetic

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        return write_synthetic(out, num_classes=10, train_per_class=20, test_per_class=5, dim=8, latent=4, spread=1.0)

    monkeypatch.setattr(extract.run, "extract_features", extract_features)


def _fake_speed(monkeypatch) -> None:
    import fedhead.bench.speed

    monkeypatch.setattr(fedhead.bench.speed, "measure_speed", lambda **kw: {})


# ---------------------------------------------------------------- the test


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_refused_in_one_line(case: Case, inputs, tmp_path, monkeypatch):
    paths = _case_paths(tmp_path, inputs)
    argv = shlex.split(f"{case.base} {case.bad}".format(**paths))
    out = _out_of(argv)
    before = _snapshot(out) if out is not None else None
    lock_before = out is not None and Path(f"{out}.lock").exists()
    cwd = tmp_path / "cwd"  # default outputs (runs/, reports/, cache/) would land here
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    flower_calls = _fake_flower(monkeypatch) if case.command in ("flower simulate", "bench flower") else None
    if case.fake == "demo":
        _fake_demo_extraction(monkeypatch)
    if case.command == "bench speed":
        _fake_speed(monkeypatch)

    res = runner.invoke(cli.app, argv)

    shown = f"$ fedhead {' '.join(argv)}\nexit {res.exit_code}\nstderr: {res.stderr!r}\nstdout: {res.stdout[-500:]!r}"
    if flower_calls is not None:
        assert not flower_calls, "reached Flower's run_simulation before refusing the input\n" + shown
    assert res.exit_code != 0, shown
    assert res.exception is None or isinstance(res.exception, SystemExit), (repr(res.exception), shown)
    assert "Traceback" not in res.output, shown
    assert "internal error" not in res.output, shown
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    assert lines[0].startswith("error: ") and len(lines[0]) <= MAX_MESSAGE, shown
    assert case.expect in lines[0], shown
    if out is not None:
        assert _snapshot(out) == before, f"{out} changed\n{shown}"
        assert Path(f"{out}.lock").exists() == lock_before, f"{out}.lock left behind\n{shown}"
    assert not any(cwd.iterdir()), f"wrote {sorted(p.name for p in cwd.iterdir())} in the working directory\n{shown}"


def test_the_matrix_covers_every_command():
    """At least 60 bad inputs, and every command the brief names has its own."""
    from collections import Counter

    per = Counter(c.command for c in CASES)
    assert len(CASES) >= 60
    for cmd in (
        "extract",
        "info",
        "train",
        "synth",
        "demo",
        "scratch",
        "bench ablation",
        "bench partitions",
        "bench encoders",
        "bench noise",
        "bench participation",
        "bench geometry",
        "bench openset",
        "bench speed",
        "bench extract",
        "bench flower",
        "bench baselines",
        "bench papers",
        "bench privacy",
        "flower simulate",
    ):
        assert per[cmd] >= 3, (cmd, per[cmd])


# ---------------------------------------------------------------- flower superlink / supernode: TLS and keys
# The deployment commands start processes (flower-superlink via Popen, flower-supernode via execve): every bad
# certificate or key file must be refused before any of them starts. Processes are replaced by stand-ins that
# record the call (reaching one fails the case); the other checks are those of the matrix above.

SUPERLINK = (
    "flower superlink --host 127.0.0.1 --port 9 --features {store} --clients 2 --rounds 1 --out {out} "
    "--ssl-certfile {cert} --ssl-keyfile {key} --ssl-ca-certfile {ca}"
)
SERVE = "flower superlink --host 127.0.0.1 --port 9 --ssl-certfile {cert} --ssl-keyfile {key} --ssl-ca-certfile {ca}"
SUPERNODE = (
    "flower supernode --superlink 127.0.0.1:9 --features {store} --partition-id 0 --port 9 "
    "--root-certificates {ca} --auth-supernode-private-key {nodekey}"
)
_ROOT = hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0

DEPLOY_CASES = [
    # ---- flower superlink: TLS files
    Case(SUPERLINK, "--ssl-certfile {missing}", "'--ssl-certfile'"),
    Case(SUPERLINK, "--ssl-certfile {text}", "'--ssl-certfile'"),
    Case(SUPERLINK, "--ssl-certfile {empty}", "'--ssl-certfile'"),
    Case(SUPERLINK, "--ssl-certfile {key}", "'--ssl-certfile'", name="--ssl-certfile <a private key>"),
    Case(SUPERLINK, "--ssl-certfile {folder}", "'--ssl-certfile'", name="--ssl-certfile <a folder>"),
    Case(SUPERLINK, "--ssl-certfile {unreadable}", "'--ssl-certfile'", name="--ssl-certfile <unreadable>"),
    Case(SUPERLINK, "--ssl-keyfile {missing}", "'--ssl-keyfile'"),
    Case(SUPERLINK, "--ssl-keyfile {cert}", "'--ssl-keyfile'", name="--ssl-keyfile <a certificate>"),
    Case(SUPERLINK, "--ssl-keyfile {otherkey}", "'--ssl-keyfile'", name="--ssl-keyfile <another certificate's>"),
    Case(SUPERLINK, "--ssl-keyfile {enckey}", "'--ssl-keyfile'", name="--ssl-keyfile <encrypted>"),
    Case(SUPERLINK, "--ssl-keyfile {nodekey}", "'--ssl-keyfile'", name="--ssl-keyfile <an OpenSSH key>"),
    Case(SUPERLINK, "--ssl-ca-certfile {missing}", "'--ssl-ca-certfile'"),
    Case(SUPERLINK, "--ssl-ca-certfile {text}", "'--ssl-ca-certfile'"),
    Case(
        SUPERLINK,
        "--ssl-ca-certfile {otherca}",
        "'--ssl-ca-certfile' CA",
        name="--ssl-ca-certfile <a CA that did not sign --ssl-certfile>",
    ),
    Case(
        SUPERLINK,
        "--ssl-certfile {nosan} --ssl-keyfile {nosankey}",
        "subjectAltName",
        name="--ssl-certfile <does not name 127.0.0.1>",
    ),
    Case(
        SUPERLINK,
        "--ssl-certfile {expired} --ssl-keyfile {expiredkey}",
        "'--ssl-certfile' certificate must be valid",
        name="--ssl-certfile <expired>",
    ),
    Case(
        SUPERLINK.replace(" --ssl-ca-certfile {ca}", ""),
        "",
        "'--ssl-ca-certfile'",
        name="--ssl-certfile without --ssl-ca-certfile",
    ),
    Case(SUPERLINK, "--insecure", "'--insecure'", name="--insecure with certificates"),
    Case(SUPERLINK.split(" --ssl-certfile")[0], "", "'--insecure'", name="neither TLS nor --insecure"),
    # ---- flower superlink: SuperNode public keys
    Case(SUPERLINK, "--auth-public-keys {missing}", "'--auth-public-keys'"),
    Case(SUPERLINK, "--auth-public-keys {text}", "'--auth-public-keys'"),
    Case(SUPERLINK, "--auth-public-keys {empty}", "'--auth-public-keys'"),
    Case(SUPERLINK, "--auth-public-keys {folder}", "'--auth-public-keys'", name="--auth-public-keys <a folder>"),
    Case(SUPERLINK, "--auth-public-keys {nodekey}", "'--auth-public-keys'", name="--auth-public-keys <a private key>"),
    Case(SUPERLINK, "--auth-public-keys {edpub}", "'--auth-public-keys'", name="--auth-public-keys <ed25519>"),
    Case(SUPERLINK, "--auth-public-keys {pempub}", "'--auth-public-keys'", name="--auth-public-keys <PEM>"),
    Case(
        SUPERLINK,
        "--auth-public-keys {nodepub} --auth-public-keys {nodepub}",
        "'--auth-public-keys'",
        name="--auth-public-keys <the same key twice>",
    ),
    Case(
        SUPERLINK,
        "--auth-public-keys {nodepub} --auth-public-keys {missing}",
        "'--auth-public-keys'",
        name="--auth-public-keys <one good, one missing>",
    ),
    Case(
        SUPERLINK.split(" --ssl-certfile")[0],
        "--insecure --auth-public-keys {nodepub}",
        "'--auth-public-keys'",
        name="--auth-public-keys with --insecure",
    ),
    Case(SERVE, "--auth-public-keys {text}", "'--auth-public-keys'", name="serve: --auth-public-keys <text>"),
    Case(SUPERLINK, "--secure-aggregation", "'--secure-aggregation'", name="--secure-aggregation with 2 clients"),
    Case(SUPERLINK, "--wait-timeout 0", "'--wait-timeout'"),
    Case(SUPERLINK, "--round-timeout -1", "'--round-timeout'"),
    Case(SUPERLINK, "--port 70000", "'--port'"),
    Case(SUPERNODE, "--port 0", "'--port'"),
    Case(
        SERVE,
        "--ssl-keyfile {otherkey} --auth-public-keys {nodepub}",
        "'--ssl-keyfile'",
        name="serve: --ssl-keyfile <another certificate's>",
    ),
    # ---- flower supernode
    Case(SUPERNODE, "--root-certificates {missing}", "'--root-certificates'"),
    Case(SUPERNODE, "--root-certificates {text}", "'--root-certificates'"),
    Case(SUPERNODE, "--root-certificates {key}", "'--root-certificates'", name="--root-certificates <a key>"),
    Case(SUPERNODE, "--root-certificates {folder}", "'--root-certificates'", name="--root-certificates <a folder>"),
    Case(
        SUPERNODE, "--root-certificates {unreadable}", "'--root-certificates'", name="--root-certificates <unreadable>"
    ),
    Case(SUPERNODE, "--auth-supernode-private-key {missing}", "'--auth-supernode-private-key'"),
    Case(SUPERNODE, "--auth-supernode-private-key {text}", "'--auth-supernode-private-key'"),
    Case(SUPERNODE, "--auth-supernode-private-key {empty}", "'--auth-supernode-private-key'"),
    Case(
        SUPERNODE,
        "--auth-supernode-private-key {pemkey}",
        "'--auth-supernode-private-key'",
        name="--auth-supernode-private-key <PEM, not OpenSSH>",
    ),
    Case(
        SUPERNODE,
        "--auth-supernode-private-key {nodepub}",
        "'--auth-supernode-private-key'",
        name="--auth-supernode-private-key <the public key>",
    ),
    Case(
        SUPERNODE,
        "--auth-supernode-private-key {edkey}",
        "'--auth-supernode-private-key'",
        name="--auth-supernode-private-key <ed25519>",
    ),
    Case(
        SUPERNODE,
        "--auth-supernode-private-key {enckey_ssh}",
        "'--auth-supernode-private-key'",
        name="--auth-supernode-private-key <encrypted>",
    ),
    Case(
        SUPERNODE,
        "--auth-supernode-private-key {folder}",
        "'--auth-supernode-private-key'",
        name="--auth-supernode-private-key <a folder>",
    ),
    Case(SUPERNODE, "--insecure", "'--insecure'", name="--insecure with --root-certificates"),
    Case(
        SUPERNODE.replace("--root-certificates {ca}", "--insecure"),
        "",
        "'--auth-supernode-private-key'",
        name="--auth-supernode-private-key with --insecure",
    ),
    Case(
        SUPERNODE.replace(" --root-certificates {ca}", ""),
        "",
        "'--insecure'",
        name="neither --root-certificates nor --insecure",
    ),
    Case(SUPERNODE, "--state-dir {cert}", "'--state-dir'", name="--state-dir <a file>"),
    Case(SUPERNODE, "--state-dir {cert}/node", "'--state-dir'", name="--state-dir <below a file>"),
    Case(SUPERNODE, "--state-dir {folder} --port 0", "'--port'", name="--state-dir with a bad --port"),
    Case(SUPERNODE, "--delay -1", "'--delay'"),
]

_deploy_ids = [c.id for c in DEPLOY_CASES]
assert len(_deploy_ids) == len(set(_deploy_ids)), sorted({i for i in _deploy_ids if _deploy_ids.count(i) > 1})


@pytest.fixture(scope="session")
def key_inputs(tmp_path_factory) -> dict[str, str]:
    """A CA, the server's certificate and key, a SuperNode key pair (OpenSSH) and files of the wrong kind."""
    import sys

    pytest.importorskip("flwr", reason="Flower is not installed (pip install 'fedhead[flower]')")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    sys.path.insert(0, str(Path(__file__).parent))
    from certs import make_ca, make_node_key, make_server_cert

    d = tmp_path_factory.mktemp("bad-keys")
    ca = make_ca(d, "ca")
    cert, key = make_server_cert(ca, d, "server")
    _, otherkey = make_server_cert(ca, d, "other")
    nosan, nosankey = make_server_cert(ca, d, "nosan", hosts=("example.org",))
    expired, expiredkey = make_server_cert(ca, d, "expired", expired=True)
    otherca = make_ca(d, "other-ca")
    nodekey, nodepub = make_node_key(d, "node")
    pem = serialization.Encoding.PEM
    none = serialization.NoEncryption()
    ec_key = ec.generate_private_key(ec.SECP384R1())
    (d / "node.pem").write_bytes(ec_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, none))
    (d / "node-pub.pem").write_bytes(
        ec_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    (d / "enc.key").write_bytes(
        ec_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"secret"))
    )
    (d / "enc-ssh").write_text(_ENCRYPTED_OPENSSH_KEY)
    ed = ed25519.Ed25519PrivateKey.generate()
    (d / "ed").write_bytes(ed.private_bytes(pem, serialization.PrivateFormat.OpenSSH, none))
    (d / "ed.pub").write_bytes(
        ed.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n"
    )
    (d / "text.pem").write_text("not a certificate or a key\n")
    (d / "empty.pem").write_bytes(b"")
    (d / "folder").mkdir()
    unreadable = d / "unreadable.pem"
    unreadable.write_bytes(ca.cert.read_bytes())
    unreadable.chmod(0)
    return {
        "ca": str(ca.cert),
        "cert": str(cert),
        "key": str(key),
        "otherkey": str(otherkey),
        "otherca": str(otherca.cert),
        "nosan": str(nosan),
        "nosankey": str(nosankey),
        "expired": str(expired),
        "expiredkey": str(expiredkey),
        "nodekey": str(nodekey),
        "nodepub": str(nodepub),
        "pemkey": str(d / "node.pem"),
        "pempub": str(d / "node-pub.pem"),
        "enckey": str(d / "enc.key"),
        "enckey_ssh": str(d / "enc-ssh"),
        "edkey": str(d / "ed"),
        "edpub": str(d / "ed.pub"),
        "text": str(d / "text.pem"),
        "empty": str(d / "empty.pem"),
        "folder": str(d / "folder"),
        "unreadable": str(unreadable),
        "missing": str(d / "missing.pem"),
    }


# a throw-away P-384 key, passphrase "secret" (ssh-keygen -t ecdsa -b 384 -N secret; cryptography needs bcrypt
# to write one)
_ENCRYPTED_OPENSSH_KEY = """-----BEGIN OPENSSH PRIVATE KEY-----
b3BlbnNzaC1rZXktdjEAAAAACmFlczI1Ni1jdHIAAAAGYmNyeXB0AAAAGAAAABDKis3gvw
YunGNSdeh+JWF4AAAAEAAAAAEAAACIAAAAE2VjZHNhLXNoYTItbmlzdHAzODQAAAAIbmlz
dHAzODQAAABhBIgC7TO7uevmfhrev/JiXbRYd1gdj2Rzpzf1nqLcrfE+3odC47FSdX86bf
QFhOKd/OQRvG73UrM46NWt+DdSQ8HpU9QomyghQLebkxrPoVTgF1a7nzNz843Ch4f7JsS5
9gAAAND1VeYQJa13Ub6RptMKhja1ChLhpZ/ndMgduMi3mzBxe6zHVS2N3ptSLXsQZ8u7+I
ooGsPR9uqgAC/LXeclXFxAGOqMsgmbVBseCh0IzlLYkn0y0M1tVXCQ51PslSzCsXikluEZ
whuZD6KGVv09y/T37WYK8haNkqPsknPd7IN80rTIHjsL+E49KfEzCGqxGsogy0ClNch7sY
eIAK5KN/Ri59m7SP9TdRtAfCKG7fw8wAi9gEa7jmuN6qu5XcBiz9Vm+5Vxyrgqz6h0R2hr
1U/3
-----END OPENSSH PRIVATE KEY-----
"""


def _fake_processes(monkeypatch) -> list:
    """Stand-ins for every way the deployment commands start a process: they record the call and raise."""
    import os
    import subprocess

    calls: list = []

    def starts(name):
        def fake(*args, **kw):
            calls.append((name, args[:1]))
            raise RuntimeError(f"stand-in {name}: the inputs passed every check, a process would start here")

        return fake

    monkeypatch.setattr(os, "execve", starts("os.execve"))
    for name in ("Popen", "run", "call"):
        monkeypatch.setattr(subprocess, name, starts(f"subprocess.{name}"))
    return calls


def _unreadable_as_root(monkeypatch, path: str) -> None:
    """root reads a file without read permission: reading ``path`` fails as it would for anyone else."""
    real = Path.read_bytes

    def read_bytes(self):
        if str(self) == path:
            raise PermissionError(13, "Permission denied", path)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in DEPLOY_CASES])
def test_bad_key_or_certificate_is_refused_before_any_process(case: Case, inputs, key_inputs, tmp_path, monkeypatch):
    paths = {**_case_paths(tmp_path, inputs), **key_inputs}
    if "{unreadable}" in case.bad and _ROOT:
        _unreadable_as_root(monkeypatch, key_inputs["unreadable"])
    argv = shlex.split(f"{case.base} {case.bad}".format(**paths))
    out = _out_of(argv)
    before = _snapshot(out) if out is not None else None
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    started = _fake_processes(monkeypatch)

    res = runner.invoke(cli.app, argv)

    shown = f"$ fedhead {' '.join(argv)}\nexit {res.exit_code}\nstderr: {res.stderr!r}\nstdout: {res.stdout[-500:]!r}"
    assert not started, f"started {started} before refusing the input\n" + shown
    assert res.exit_code != 0, shown
    assert res.exception is None or isinstance(res.exception, SystemExit), (repr(res.exception), shown)
    assert "Traceback" not in res.output and "internal error" not in res.output, shown
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    assert lines[0].startswith("error: ") and len(lines[0]) <= MAX_MESSAGE, shown
    assert case.expect in lines[0], shown
    if out is not None:
        assert _snapshot(out) == before, f"{out} changed\n{shown}"
        assert not Path(f"{out}.lock").exists(), f"{out}.lock left behind\n{shown}"
    assert not any(cwd.iterdir()), f"wrote {sorted(p.name for p in cwd.iterdir())} in the working directory\n{shown}"


def test_the_deploy_cases_reach_a_process_with_good_files(inputs, key_inputs, tmp_path, monkeypatch):
    """The bases of the cases above are valid: with good files both commands get as far as starting Flower
    (so each case is refused for its bad input, not for something in the base)."""
    paths = {**_case_paths(tmp_path, inputs), **key_inputs}
    monkeypatch.chdir(tmp_path)
    for base in (
        SUPERLINK,
        SUPERLINK + " --auth-public-keys {nodepub}",
        SERVE + " --auth-public-keys {nodepub}",
        SUPERNODE,
    ):
        started = _fake_processes(monkeypatch)
        res = runner.invoke(cli.app, shlex.split(base.format(**paths)))
        assert started and started[0][0] in ("subprocess.Popen", "os.execve"), (base, res.stderr)


def test_supernode_state_dir_reaches_the_node_config(inputs, key_inputs, tmp_path, monkeypatch):
    """A good --state-dir is made (with its parents) and named in the node config Flower's SuperNode gets."""
    import os

    paths = {**_case_paths(tmp_path, inputs), **key_inputs}
    argv: list = []

    def execve(exe, args, env):
        argv.extend(args)
        raise RuntimeError("stand-in os.execve")

    monkeypatch.setattr(os, "execve", execve)
    state = tmp_path / "node disk" / "state"
    runner.invoke(cli.app, shlex.split(SUPERNODE.format(**paths)) + ["--state-dir", str(state)])
    assert state.is_dir()
    node_config = shlex.split(argv[argv.index("--node-config") + 1])
    assert f"state-dir={state.resolve()}" in node_config and "partition-id=0" in node_config
