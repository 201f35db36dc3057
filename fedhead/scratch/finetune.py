"""``fedhead finetune``: federated fine-tuning of a pretrained encoder on raw images, beside the head on its frozen
features (the comparison the OvA-LP paper makes against FFT-MoE and PFPT, its Section 4.3).

The model is :class:`fedhead.core.peft.FineTuned` (a pretrained encoder, as ``fedhead extract`` loads it, and a
linear softmax classifier); ``--peft`` picks what trains (:mod:`fedhead.core.peft`). One copy of the model exists
in memory: a simulated client loads the global trainable vector into it, trains its local epochs, and reads its
trainable vector out, so the frozen weights are shared by every client and a client's state is only what it
trains. The aggregation rule and the server optimiser are the objects ``fedhead train`` uses
(:mod:`fedhead.core.aggregate`, :mod:`fedhead.core.serveropt`), applied to the trainable vector ``[1, P]``; only
the trainable tensors travel, and their bytes are the rule's message, counted exactly.

``--peft head`` is the OvA-LP path itself: the frozen encoder's features are extracted once with
:func:`extract.run.extract_features` (the same function as ``fedhead extract``, into the same cache) and a head is
trained on them by ``fedhead train``'s trainer; its run directory is ``fedhead train``'s.

Images are decoded and resized once (the encoder's eval transform, rounded to uint8 as ``fedhead extract`` does)
and normalised per batch; the images of every client live in one uint8 tensor on the device. Each client keeps a
``--val-fraction`` of its samples out of training: the global model's accuracy on those pooled validation parts is
``val_accuracy`` (what Acc@95 is read from); the test split is ``accuracy`` at every round and is reported at the
final round, never used to choose.

The run is the one round loop's (:func:`fedhead.federation.loop.run_job`): after every round the global trainable
vector, the server optimiser's and the rule's state and the random state are checkpointed; a resumed run equals an
uninterrupted one (every random draw of a round is keyed by (seed, round, client)).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import save_file

from extract import datasets as D
from extract.encoders import Encoder, load_encoder, preprocess_batch
from extract.run import dataset_label, extract_features, sanitize
from fedhead.core.aggregate import Accumulator, create_aggregator
from fedhead.core.noise import NOISE_KINDS, apply_noise
from fedhead.core.partitions import create_partition, resolve_partition_params
from fedhead.core.peft import (
    LORA_TARGETS,
    PROMPT_MODES,
    FineTuned,
    TuneSpec,
    attach,
    load_vector,
    trainable,
    trainable_state,
    trainable_vector,
    tuning_names,
)
from fedhead.core.serveropt import ServerOptConfig, ServerOptimizer
from fedhead.federation.api import run as run_head
from fedhead.federation.loop import Job, run_job, writing
from fedhead.federation.outputs import RunReport
from fedhead.federation.rundir import RunDir, acc95_round, identity_hash, mean_std, write_summary
from fedhead.federation.tracking import check_log
from fedhead.infra.devices import resolve_device, set_cpu_threads
from fedhead.infra.errors import FedheadError, Interval, OneOf, param_error, unknown_name, validate
from fedhead.infra.files import atomic_write_json, check_out
from fedhead.infra.locks import exclusive_writer

OPTIMIZERS = ("adamw", "adam", "sgd")
PRECISIONS = ("auto", "fp32", "bf16")
FT_FIELDS = ["seed", "round", "stage", "accuracy", "val_accuracy", "train_loss", "client_ms", "server_ms",
             "bytes_up_per_client", "bytes_total", "clients"]  # fmt: skip


@dataclass
class FinetuneConfig:
    """One federated fine-tuning run (``fedhead finetune``'s options; the flag is ``--`` + the name with ``-``)."""

    dataset: str
    data_dir: str | None
    encoder: str
    weights: str | None = None  # a checkpoint file, "registry" (installed Lite0/Lite1 weights) or None (the hub)
    pretrained: bool = True  # False: random init (tests)
    image_size: int | None = None  # None: the encoder's default
    peft: str = "lora"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "auto"
    prompt_mode: str = "auto"
    prompt_tokens: int = 10
    prompt_width: int = 4
    experts: int = 4
    top_k: int = 2
    pfpt_pool: int = 20
    head: str = "ova2"  # --peft head: the head fedhead train fits on the frozen features
    partition: str = "dirichlet"
    partition_params: dict = field(default_factory=dict)
    clients: int = 10
    participation: float = 1.0
    rounds: int = 10
    local_epochs: int = 1
    batch_size: int = 32
    optimizer: str = "adamw"
    lr: float | None = None  # None: 1e-3 (adamw / adam), 0.01 (sgd); --peft head: fedhead train's recipe
    momentum: float = 0.9  # sgd only
    weight_decay: float = 0.0
    prox_mu: float = 0.0  # FedProx's (mu/2)||w - w_global||^2 on the trainable tensors (0: off)
    aggregate: str = "fedavg"
    server_opt: str = "fedavg"
    server_lr: float | None = None
    seeds: list[int] = field(default_factory=lambda: [0])
    limit: int | None = None  # a stratified subset of this many images per split (as fedhead extract --limit)
    val_fraction: float = 0.1
    noise: str = "none"
    noise_rate: float = 0.0
    device: str = "auto"
    precision: str = "auto"  # auto: bf16 autocast on CUDA, fp32 elsewhere
    eval_batch: int = 256
    cache: str = "cache"  # --peft head: the store goes to CACHE/<dataset>/<encoder>-<size|default>.h5 (reused)
    plots: bool = True
    log: str = "none"
    log_dir: str | None = None

    def spec(self) -> TuneSpec:
        return TuneSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TuneSpec)})


def resolve_finetune(cfg: FinetuneConfig) -> FinetuneConfig:
    """A validated copy with the learning rate filled in (one-line errors naming the flag)."""
    c = dataclasses.replace(cfg, seeds=list(cfg.seeds), partition_params=dict(cfg.partition_params))
    if c.peft not in tuning_names():
        raise unknown_name("--peft", c.peft, tuning_names(), "fine-tuning kind")
    if c.dataset not in D.dataset_names():
        raise unknown_name("--dataset", c.dataset, D.dataset_names(), "dataset")
    validate("--clients", c.clients, Interval(1, None, integer=True))
    validate("--participation", c.participation, Interval(0, 1, closed="right"))
    validate("--rounds", c.rounds, Interval(1, None, integer=True))
    validate("--local-epochs", c.local_epochs, Interval(1, None, integer=True))
    validate("--batch-size", c.batch_size, Interval(1, None, integer=True))
    validate("--lora-rank", c.lora_rank, Interval(1, None, integer=True), "Use a rank of 1 or more, e.g. 8.")
    validate("--lora-alpha", c.lora_alpha, Interval(0, None, closed="neither"))
    validate("--lora-dropout", c.lora_dropout, Interval(0, 1, closed="left"))
    validate("--prompt-tokens", c.prompt_tokens, Interval(1, None, integer=True))
    validate("--prompt-width", c.prompt_width, Interval(1, None, integer=True))
    validate("--prompt-mode", c.prompt_mode, OneOf(PROMPT_MODES))
    if c.lora_targets not in LORA_TARGETS and not c.lora_targets.strip():
        raise param_error("--lora-targets", c.lora_targets, "is empty", "Use auto, or a regular expression.")
    validate("--experts", c.experts, Interval(1, None, integer=True))
    validate("--top-k", c.top_k, Interval(1, c.experts, integer=True), f"Use 1 to --experts ({c.experts}).")
    validate("--pfpt-pool", c.pfpt_pool, Interval(1, None, integer=True))
    validate("--optimizer", c.optimizer, OneOf(OPTIMIZERS))
    if c.lr is None and c.peft != "head":
        c.lr = 0.01 if c.optimizer == "sgd" else 1e-3
    if c.lr is not None:
        validate("--lr", c.lr, Interval(0, None, closed="neither"))
    validate("--momentum", c.momentum, Interval(0, 1, closed="left"))
    validate("--weight-decay", c.weight_decay, Interval(0, None))
    validate("--prox-mu", c.prox_mu, Interval(0, None))
    validate("--val-fraction", c.val_fraction, Interval(0, 1, closed="left"))
    validate("--precision", c.precision, OneOf(PRECISIONS))
    validate("--eval-batch", c.eval_batch, Interval(1, None, integer=True))
    if c.limit is not None:
        validate("--limit", c.limit, Interval(1, None, integer=True))
    if c.noise not in NOISE_KINDS:
        raise unknown_name("--noise", c.noise, NOISE_KINDS, "noise kind")
    validate("--noise-rate", c.noise_rate, Interval(0, 1, closed="left"))
    if not c.seeds:
        raise FedheadError("The '--seeds' parameter needs at least one value. Got [] instead.")
    for s in c.seeds:
        validate("--seeds", s, Interval(0, None, integer=True))
    create_aggregator(c.aggregate)
    c.partition_params = resolve_partition_params(c.partition, **c.partition_params)
    if c.peft != "head":
        ServerOptConfig(c.server_opt, lr=c.server_lr).resolved()
    return c


# ---------------------------------------------------------------- data: decoded and resized once


@dataclass
class Images:
    """Both splits as uint8 [N, S, S, 3] at the encoder's input size (the eval transform's resize and crop done)."""

    train_x: torch.Tensor
    train_y: np.ndarray
    test_x: torch.Tensor
    test_y: np.ndarray
    classes: list[str]


def _resized(split: D.ImageSplit, enc: Encoder, batch: int = 256) -> torch.Tensor:
    """The split's images through the encoder's resize and centre crop, rounded to uint8 like ``fedhead extract``
    (normalisation with mean 0 and std 1/255 is the identity on those values)."""
    pre = dataclasses.replace(enc.preprocessing, mean=(0.0, 0.0, 0.0), std=(1 / 255, 1 / 255, 1 / 255))
    s = pre.image_size
    out = torch.empty((len(split), s, s, 3), dtype=torch.uint8)
    if split.in_memory:
        for i in range(0, len(split), batch):
            x = torch.from_numpy(np.ascontiguousarray(split.images[i : i + batch]))
            out[i : i + len(x)] = preprocess_batch(x, pre).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        return out
    for i in range(len(split)):
        img = D.try_image(split, i)
        if isinstance(img, D.Unreadable):
            raise FedheadError(f"The image {img.path!r} cannot be read ({img.reason}). Fix or remove it and re-run.")
        x = torch.from_numpy(np.ascontiguousarray(img))[None]
        out[i] = preprocess_batch(x, pre).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)[0]
    return out


def load_images(cfg: FinetuneConfig, enc: Encoder) -> Images:
    """Both splits of ``cfg.dataset`` (``--limit``: the same stratified subset as ``fedhead extract --limit``)."""
    splits = {}
    for s in ("train", "test"):
        split = D.load_dataset(cfg.dataset, cfg.data_dir, s)
        if cfg.limit is not None:
            split = split.subset(D.select_limit(split.labels, cfg.limit))
        splits[s] = split
    tr, te = splits["train"], splits["test"]
    return Images(_resized(tr, enc), np.asarray(tr.labels, np.int64), _resized(te, enc),
                  np.asarray(te.labels, np.int64), list(tr.class_names))  # fmt: skip


_LOADED: dict = {}  # the last encoder and images this process loaded (bench fft runs many configs on the same)


def _stamp(path) -> tuple:
    """A file's or folder's identity for the cache: path, size and modification time (None when absent)."""
    if path is None or not Path(path).exists():
        return (path,)
    st = Path(path).stat()
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def loaded(cfg: FinetuneConfig) -> tuple[Encoder, Images]:
    """The pristine encoder and the resized images of ``cfg``: loaded once, kept for the next run of this process
    that asks for the same encoder (name, weights file, size) and data (dataset, folder, limit). Both are only read
    (a seed's model attaches to a copy of the encoder, :func:`fresh`)."""
    ekey = (cfg.encoder, _stamp(cfg.weights) if cfg.weights not in (None, "registry") else cfg.weights,
            cfg.pretrained, cfg.image_size)  # fmt: skip
    if _LOADED.get("encoder_key") != ekey:
        _LOADED.clear()
        _LOADED["encoder"] = load_encoder(cfg.encoder, weights=cfg.weights, pretrained=cfg.pretrained,
                                          image_size=cfg.image_size)  # fmt: skip
        _LOADED["encoder_key"] = ekey
    dkey = (cfg.dataset, _stamp(cfg.data_dir), cfg.limit)
    if _LOADED.get("data_key") != dkey:
        _LOADED.pop("data", None)
        _LOADED["data"] = load_images(cfg, _LOADED["encoder"])
        _LOADED["data_key"] = dkey
    return _LOADED["encoder"], _LOADED["data"]


def normalise(x: torch.Tensor, enc: Encoder, channels_last: bool) -> torch.Tensor:
    """uint8 [B, S, S, 3] at the input size -> the encoder's normalised float input [B, 3, S, S]."""
    pre = dataclasses.replace(enc.preprocessing, resize_size=enc.preprocessing.image_size)
    return preprocess_batch(x, pre, channels_last=channels_last)


# ---------------------------------------------------------------- one seed's setup


def client_key(*parts: int) -> int:
    """A client's training key in a round: (seed, round, client) hashed (its batch order and dropout)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class Seed:
    """One seed's deterministic setup: partition, validation parts, the model with its trainable parts."""

    parts: list[np.ndarray]  # per client: its training indices (validation part removed)
    val: np.ndarray  # the pooled validation indices
    y: torch.Tensor  # training labels (after label noise) on the device
    counts: np.ndarray  # [K, C] training label counts
    info: dict


def setup_seed(cfg: FinetuneConfig, data: Images, seed: int) -> Seed:
    rng = np.random.default_rng(seed)
    y = data.train_y.copy()
    parts = create_partition(cfg.partition, y, cfg.clients, seed=seed, **cfg.partition_params)
    train_parts, val_parts = [], []
    for p in parts:
        p = np.asarray(p, dtype=np.int64)
        n_val = int(round(cfg.val_fraction * len(p))) if len(p) > 1 else 0
        perm = rng.permutation(len(p))
        val_parts.append(np.sort(p[perm[:n_val]]))
        train_parts.append(np.sort(p[perm[n_val:]]))
    info: dict = {"train_size": int(sum(len(p) for p in train_parts)), "val_size": int(sum(map(len, val_parts)))}
    if cfg.noise != "none":
        noisy, frac = apply_noise(cfg.noise, cfg.noise_rate, [y[p] for p in train_parts], len(data.classes),
                                  dataset=cfg.dataset, seed=seed)  # fmt: skip
        for p, yn in zip(train_parts, noisy):
            y[p] = yn
        info["noise_realised_fraction"] = frac
    counts = np.stack([np.bincount(y[p], minlength=len(data.classes)) for p in train_parts])
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.zeros(0, np.int64)
    return Seed(train_parts, val, torch.from_numpy(y), counts, info)


def fresh(enc: Encoder) -> Encoder:
    """A copy of the pretrained encoder to attach a seed's trainable parts to (the loaded one stays pristine)."""
    return dataclasses.replace(enc, model=copy.deepcopy(enc.model))


def build_model(cfg: FinetuneConfig, enc: Encoder, num_classes: int, seed: int):
    """The encoder (its weights shared, never copied per client) with ``--peft``'s trainable parts and a zero
    classifier; returns ``(model, tuning)``."""
    model = FineTuned(enc.model, enc.feature_dim, num_classes, enc.preprocessing.image_size)
    tuning = attach(model, cfg.spec(), seed)
    return model, tuning


# ---------------------------------------------------------------- local training and evaluation


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CUDA (``--precision auto|bf16``), nothing on CPU or with fp32."""
    if device.type == "cuda" and precision in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class Trainer:
    """What a client's local training needs; shared by the simulator and a Flower node."""

    cfg: FinetuneConfig
    enc: Encoder
    model: FineTuned
    tuning: object
    device: torch.device

    @property
    def channels_last(self) -> bool:
        return self.device.type == "cuda"

    @property
    def pad(self) -> bool:
        """On CUDA a short last batch is padded to the batch size (repeated samples, left out of the loss and the
        predictions): cuDNN then plans one input shape per run instead of one per client (a new shape cost seconds
        per client on an H100)."""
        return self.device.type == "cuda"

    def optimizer(self, params):
        c = self.cfg
        if c.optimizer == "sgd":
            return torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
        if c.optimizer == "adam":
            return torch.optim.Adam(params, lr=c.lr, weight_decay=c.weight_decay)
        return torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay)

    def train_client(
        self, theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor, key: int
    ) -> tuple[torch.Tensor, float]:
        """From the global trainable vector ``theta``, ``--local-epochs`` over the client's images ``x`` (uint8, on
        the device) and labels ``y``; returns the client's trainable vector and its mean loss. Every random draw
        (the batch order, LoRA's dropout) comes from ``key``."""
        c, model = self.cfg, self.model
        load_vector(model, theta)
        params = [p for _, p in trainable(model)]
        start = [p.detach().clone() for p in params] if c.prox_mu else None
        opt = self.optimizer(params)
        gen = torch.Generator().manual_seed(key)
        self._set_train_mode()
        losses = []
        with torch.random.fork_rng(devices=[self.device.index or 0] if self.device.type == "cuda" else []):
            torch.manual_seed(key)
            for _ in range(c.local_epochs):
                order = torch.randperm(len(y), generator=gen).to(x.device)
                for i in range(0, len(y), c.batch_size):
                    idx = order[i : i + c.batch_size]
                    real = len(idx)
                    if self.pad and real < c.batch_size:  # one input shape on CUDA: the tail is masked out
                        idx = torch.cat([idx, order[: c.batch_size - real]])
                    inp = normalise(x[idx], self.enc, self.channels_last)
                    with autocast(self.device, c.precision):
                        logits = model(inp)
                        loss = torch.nn.functional.cross_entropy(logits[:real].float(), y[idx[:real]])
                        aux = self.tuning.aux_loss(model)
                        if aux is not None:
                            loss = loss + aux
                    if start is not None:
                        loss = loss + 0.5 * c.prox_mu * sum(((p - s) ** 2).sum() for p, s in zip(params, start))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    losses.append(float(loss.detach()))
        self.model.eval()
        return trainable_vector(model), float(np.mean(losses)) if losses else float("nan")

    def _set_train_mode(self) -> None:
        """Eval mode everywhere (frozen batch-norm statistics, no dropout) but the adapters' own dropout."""
        self.model.eval()
        for n, m in self.model.named_modules():
            if "lora_dropout" in n:
                m.train()

    @torch.no_grad()
    def predict(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        """Top-1 classes (CPU) of uint8 images ``x``."""
        self.model.eval()
        out = []
        for i in range(0, len(x), batch):
            part = x[i : i + batch]
            real = len(part)
            if self.pad and real < batch:
                part = torch.cat([part, part[:1].expand(batch - real, *part.shape[1:])])
            inp = normalise(part, self.enc, self.channels_last)
            with autocast(self.device, self.cfg.precision):
                out.append(self.model(inp)[:real].float().argmax(1).cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# ---------------------------------------------------------------- the job


@dataclass
class Trained:
    """What a round's clients sent: their trainable vectors, sample counts and losses in client order; the mean
    client time when the clients measured it themselves; extra row fields of a transport."""

    vectors: list = field(default_factory=list)
    sizes: list = field(default_factory=list)
    losses: list = field(default_factory=list)
    client_ms: float | None = None
    extra: dict = field(default_factory=dict)


class FinetuneJob(Job):
    """Federated fine-tuning, one unit per seed (the loop checkpoints the global trainable vector, the rule's and
    the server optimiser's state and the random state after every round)."""

    fields = FT_FIELDS

    def __init__(self, cfg: FinetuneConfig, enc: Encoder, data: Images, device, log, run: RunDir):
        self.cfg, self.enc, self.data, self.device, self.log, self.run = cfg, enc, data, device, log, run
        self.per_round = max(1, int(round(cfg.participation * cfg.clients)))
        self.train_x = data.train_x.to(device)
        self.test_x = data.test_x.to(device)
        self.test_y = torch.from_numpy(data.test_y)

    def units(self) -> list[tuple]:
        return [(s,) for s in self.cfg.seeds]

    def label(self, unit: tuple) -> str:
        return f"{self.cfg.peft} seed {unit[0]}"

    def last_round(self, unit: tuple) -> int:
        return self.cfg.rounds

    def start(self, unit: tuple, saved: dict | None) -> tuple[int, list]:
        seed, cfg = unit[0], self.cfg
        self.seed = seed
        self.s = setup_seed(cfg, self.data, seed)
        self.s.y = self.s.y.to(self.device)
        self.trainer = None  # the previous seed's model goes before the next is built
        model, tuning = build_model(cfg, fresh(self.enc), len(self.data.classes), seed)
        model.to(self.device)
        if self.device.type == "cuda":
            model.to(memory_format=torch.channels_last)
        self.trainer = Trainer(cfg, self.enc, model, tuning, self.device)
        self.rule = create_aggregator(cfg.aggregate)
        theta = trainable_vector(model)
        self.opt = ServerOptimizer(ServerOptConfig(cfg.server_opt, lr=cfg.server_lr), (1, theta.numel()), self.device)
        self.rng = np.random.default_rng([seed, 0xF7])
        self.nbytes = self.rule.nbytes(theta[None])
        if saved is None:
            self.theta = theta
            return 1, []
        self.theta = saved["theta"].to(self.device, torch.float32)
        if hasattr(tuning, "load_state_dict"):  # a kind with server state of its own (PFPT's prompt pool)
            tuning.load_state_dict(saved.get("tuning", {}))
        self.opt.load_state_dict(saved["server_opt"])
        self.rule.load_state_dict(saved["rule"])
        self.rng.bit_generator.state = saved["rng"]
        return int(saved["round"]) + 1, [dict(r) for r in saved["rows"]]

    def round(self, unit: tuple, rnd: int) -> dict:
        """Select, train the selected clients (:meth:`train_clients`), aggregate, evaluate."""
        seed = unit[0]
        selected = np.sort(self.rng.choice(self.cfg.clients, size=self.per_round, replace=False))
        selected = [int(k) for k in selected if len(self.s.parts[k]) > 0]
        row: dict = {"seed": seed, "round": rnd}
        t0 = time.perf_counter()
        done = self.train_clients(seed, rnd, selected) if selected else Trained()
        self._sync()
        t1 = time.perf_counter()
        if not done.vectors:
            row.update(stage="skipped" if not selected else "failed", train_loss=float("nan"), client_ms=0.0,
                       server_ms=0.0, bytes_up_per_client=0, bytes_total=0, clients=0)  # fmt: skip
        else:
            self.aggregate(seed, rnd, len(selected), done.vectors, done.sizes)
            t2 = time.perf_counter()
            client_ms = done.client_ms if done.client_ms is not None else (t1 - t0) * 1000 / len(done.vectors)
            row.update(stage="train", train_loss=float(np.mean(done.losses)), client_ms=client_ms,
                       server_ms=(t2 - t1) * 1000, bytes_up_per_client=self.nbytes,
                       bytes_total=2 * self.nbytes * len(done.vectors), clients=len(done.vectors))  # fmt: skip
        row.update(done.extra)
        row.update(self.evaluate())
        return row

    def train_clients(self, seed: int, rnd: int, selected: list[int]) -> "Trained":
        """The selected clients' trainable vectors, in client order (one model, loaded per client: the frozen
        weights are shared). A transport that trains on other machines overrides this."""
        out = Trained()
        for k in selected:
            idx = torch.from_numpy(self.s.parts[k]).to(self.device)
            vec, loss = self.trainer.train_client(
                self.theta, self.train_x[idx], self.s.y[idx], client_key(seed, rnd, k)
            )
            out.vectors.append(vec)
            out.sizes.append(len(idx))
            out.losses.append(loss)
        return out

    def aggregate(self, seed: int, rnd: int, sampled: int, vectors: list, sizes: list[int]) -> None:
        """The server step: the rule's aggregate of the vectors (or the ``--peft`` kind's own), then the server
        optimiser."""
        tuning = self.trainer.tuning
        if tuning.aggregate is not None:
            new = tuning.aggregate(self.trainer.model, self.theta, torch.stack(vectors), torch.tensor(sizes),
                                   self.cfg.spec())  # fmt: skip
        else:
            acc = Accumulator(self.rule, self.theta[None], seed=seed, rnd=rnd, sampled=sampled)
            for vec, n in zip(vectors, sizes):
                acc.add(vec[None, None], torch.tensor([n], device=self.device),
                        torch.ones(1, 1, dtype=torch.bool, device=self.device))  # fmt: skip
            new = acc.finish()[0]
        self.theta = self.opt.step(self.theta[None], new[None].to(self.theta.dtype))[0]
        self._sync()

    def evaluate(self) -> dict:
        """The global model's accuracy on the test split and on the clients' pooled validation parts."""
        s, cfg = self.s, self.cfg
        load_vector(self.trainer.model, self.theta)
        pred = self.trainer.predict(self.test_x, cfg.eval_batch)
        out = {"accuracy": float((pred == self.test_y).float().mean()), "val_accuracy": float("nan")}
        if len(s.val):
            vi = torch.from_numpy(s.val).to(self.device)
            vp = self.trainer.predict(self.train_x[vi], cfg.eval_batch)
            out["val_accuracy"] = float((vp == s.y[vi].cpu()).float().mean())
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def unit_state(self) -> dict:
        state = {"theta": self.theta.detach().cpu(), "server_opt": self.opt.state_dict(),
                 "rule": self.rule.state_dict(), "rng": self.rng.bit_generator.state}  # fmt: skip
        if hasattr(self.trainer.tuning, "state_dict"):
            state["tuning"] = self.trainer.tuning.state_dict()
        return state

    def progress_info(self, row: dict) -> str:
        return f"acc {row['accuracy']:.3f} val {row['val_accuracy']:.3f}"

    def finish_unit(self, unit: tuple, rows: list) -> tuple[list, dict]:
        """The seed's model: ``model-seed<S>.safetensors`` (the trainable tensors) and its card ``.json``."""
        seed = unit[0]
        load_vector(self.trainer.model, self.theta)
        write_model(self.run, self.cfg, self.enc, self.trainer.model, self.data.classes, seed, rows)
        return [], {"counts": self.s.counts, "info": self.s.info, "trainable": int(self.theta.numel())}

    def finish(self, run: RunDir, done: list, rows: list, wall_s: float) -> dict:
        return _finish(self.cfg, run, done, wall_s)

    def report(self, done: list, summary: dict) -> RunReport:
        cfg = self.cfg
        return RunReport(plots=cfg.plots, log=cfg.log, log_dir=cfg.log_dir,
                         title=f"{cfg.peft} on {cfg.encoder}, {cfg.dataset}, {cfg.partition}, {cfg.clients} clients",
                         counts=np.asarray(done[0]["counts"]), labels=list(self.data.classes),
                         seed=cfg.seeds[0] if len(cfg.seeds) > 1 else None, params=identity_fields(cfg))  # fmt: skip


MODEL_FORMAT = "fedhead-finetuned/1"


def write_model(run: RunDir, cfg: FinetuneConfig, enc: Encoder, model: FineTuned, classes, seed: int, rows) -> None:
    """The seed's trainable tensors (safetensors) and a card naming everything needed to rebuild the model offline:
    the encoder and its weights (source and hash), the preprocessing, the ``--peft`` kind and its parameters."""
    path = run.path / f"model-seed{seed}.safetensors"
    with writing(run, path):
        tmp = path.with_suffix(".safetensors.tmp")
        save_file({n: t.contiguous() for n, t in trainable_state(model).items()}, str(tmp))
        tmp.replace(path)
    card = {
        "format": MODEL_FORMAT,
        "seed": seed,
        "encoder": cfg.encoder,
        "weights": cfg.weights,
        "pretrained": cfg.pretrained,
        "weights_source": enc.weights_source,
        "weights_sha256": enc.weights_sha256,
        "image_size": enc.preprocessing.image_size,
        "preprocessing": enc.preprocessing.as_dict(),
        "feature_dim": enc.feature_dim,
        "tuning": cfg.spec().as_dict(),
        "classes": list(classes),
        "final_accuracy": rows[-1]["accuracy"],
        "rounds": len(rows),
        "tensors": path.name,
    }
    card_path = run.path / f"model-seed{seed}.json"
    with writing(run, card_path):
        atomic_write_json(card_path, card)


def identity_fields(cfg: FinetuneConfig) -> dict:
    d = dataclasses.asdict(cfg)
    for key in ("device", "plots", "log", "log_dir", "eval_batch", "cache"):
        d.pop(key, None)
    if d["data_dir"] is not None:
        d["data_dir"] = str(Path(d["data_dir"]).resolve())
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def _recorded_identity(record: dict) -> dict:
    names = {f.name for f in dataclasses.fields(FinetuneConfig)}
    return identity_fields(FinetuneConfig(**{k: v for k, v in record.items() if k in names}))


def seed_summary(seed: int, rows: list[dict]) -> dict:
    """One seed's figures: the test split at the final round; Acc@95 read off the validation curve (the test
    curve when there is no validation part), with the bytes and time to it."""
    trained = [r for r in rows if r["stage"] != "skipped"] or rows
    on = "val_accuracy" if all(np.isfinite(r.get("val_accuracy", float("nan"))) for r in rows) else "accuracy"
    curve = [r[on] for r in rows]
    a95 = acc95_round(curve)
    upto = rows[:a95] if a95 else rows
    return {
        "seed": seed,
        "final_accuracy": rows[-1]["accuracy"],
        "final_val_accuracy": rows[-1].get("val_accuracy"),
        "acc95_round": a95,
        "acc95_on": on,
        "bytes_to_acc95": int(sum(r["bytes_total"] for r in upto)) if a95 else None,
        "client_s_to_acc95": float(sum(r["client_ms"] * max(r.get("clients", 1), 1) for r in upto) / 1000)
        if a95
        else None,  # fmt: skip
        "client_ms": float(np.mean([r["client_ms"] for r in trained])),
        "server_ms": float(np.mean([r["server_ms"] for r in trained])),
        "bytes_up_per_client": float(trained[-1]["bytes_up_per_client"]),
        "bytes_total": int(sum(r["bytes_total"] for r in rows)),
    }


def _finish(cfg: FinetuneConfig, run: RunDir, done: list, wall: float) -> dict:
    per_seed = [seed_summary(seed, d["rows"]) for seed, d in zip(cfg.seeds, done)]
    summary = {"command": "finetune", "peft": cfg.peft, "encoder": cfg.encoder, "dataset": cfg.dataset,
               "partition": cfg.partition, "clients": cfg.clients, "seeds": cfg.seeds, "wall_seconds": wall,
               "trainable_parameters": int(done[0]["trainable"]),
               "selection": "none: the final round is reported (test split); acc95_round is read off the clients' "
               "pooled validation parts against their final round", "per_seed": per_seed}  # fmt: skip
    for key in ("final_accuracy", "final_val_accuracy", "acc95_round", "client_ms", "server_ms",
                "bytes_up_per_client", "bytes_total", "bytes_to_acc95"):  # fmt: skip
        m, sd = mean_std([s[key] for s in per_seed])
        summary[key], summary[f"{key}_std"] = m, sd
    with writing(run, run.path / "summary.json"):
        write_summary(run.path, summary)
    return summary


# ---------------------------------------------------------------- the run


def head_options(cfg: FinetuneConfig) -> dict:
    """``--peft head``: fedhead train's fields for the same experiment (the encoder's part is the store)."""
    opts = dict(head=cfg.head, partition=cfg.partition, clients=cfg.clients, participation=cfg.participation,
                rounds=cfg.rounds, local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, seeds=cfg.seeds,
                aggregate=cfg.aggregate, server_opt=cfg.server_opt, val_fraction=cfg.val_fraction,
                noise=cfg.noise, noise_rate=cfg.noise_rate, device=cfg.device, plots=cfg.plots, log=cfg.log,
                log_dir=cfg.log_dir, **{k: v for k, v in cfg.partition_params.items() if v is not None})  # fmt: skip
    if cfg.lr is not None:
        opts["lr"] = cfg.lr
    if cfg.server_lr is not None:
        opts["server_lr"] = cfg.server_lr
    if cfg.noise == "none":
        opts.pop("noise_rate")
    return opts


def features_for(cfg: FinetuneConfig, progress: bool = False) -> Path:
    """The frozen encoder's features of ``cfg``'s images: ``fedhead extract``'s store (reused when it exists)."""
    # named from the request alone (the encoder is loaded once, by the extraction; a store made by another request
    # under this name is refused by it in one line)
    stem = f"{sanitize(cfg.encoder)}-{cfg.image_size or 'default'}" + ("" if cfg.pretrained else "-random")
    stem += f"-limit{cfg.limit}" if cfg.limit else ""
    out = Path(cfg.cache) / dataset_label(cfg.dataset, cfg.data_dir) / f"{stem}.h5"
    return extract_features(cfg.dataset, cfg.data_dir, cfg.encoder, weights=cfg.weights, pretrained=cfg.pretrained,
                            image_size=cfg.image_size, limit=cfg.limit, device=cfg.device, dtype="float32",
                            out=out, progress=progress)  # fmt: skip


def run_finetune(cfg: FinetuneConfig, out_dir, log: Callable[[str], None] = lambda s: None, progress=None,
                 resume: bool = False, make_job: Callable | None = None) -> dict:  # fmt: skip
    """Validate, load, run (or resume) every seed, write the run directory; returns the summary. ``make_job(cfg,
    enc, data, device, log, run)``: the job (default :class:`FinetuneJob`, the simulator; Flower's trains the clients
    on its nodes)."""
    cfg = resolve_finetune(cfg)
    check_log(cfg.log, cfg.log_dir)
    if cfg.peft == "head":
        store = features_for(cfg, progress=bool(progress))
        result = run_head(out=out_dir, resume=resume, progress=bool(progress), features=str(store),
                          **head_options(cfg))  # fmt: skip
        return result.summary
    device = resolve_device(cfg.device)
    enc, data = loaded(cfg)
    build_model(cfg, fresh(enc), 2, 0)  # the --peft kind checked against the encoder before anything is written
    if cfg.clients > len(data.train_y):
        raise param_error("--clients", cfg.clients, f"must be <= the training images ({len(data.train_y)})",
                          "Use fewer --clients or a larger --limit.")  # fmt: skip
    out_dir = check_out(out_dir, kind="dir")
    run = RunDir(out_dir, identity_fields(cfg), resume=resume, identity_of=_recorded_identity)
    with exclusive_writer(out_dir, f"the run directory {str(out_dir)!r}"), run.interrupted():
        opened = run.open()
        if opened.kind == "finished":
            return opened.summary
        threads = None
        if device.type == "cpu":
            threads = set_cpu_threads(opened.previous.get("cpu_threads") if opened.kind != "fresh" else None)
        job = (make_job or FinetuneJob)(cfg, enc, data, device, log, run)
        config = {"command": "finetune", **dataclasses.asdict(cfg), "device_resolved": str(device),
                  "cpu_threads": threads, "torch_version": torch.__version__, "classes": data.classes,
                  "weights_source": enc.weights_source, "weights_sha256": enc.weights_sha256,
                  "preprocessing": enc.preprocessing.as_dict(),
                  "bytes_accounting": "per round, each participating client downloads the global trainable tensors "
                  "and uploads the rule's message of its own (float32), bytes_total = down + up"}  # fmt: skip
        with writing(run, out_dir / "config.json"):
            run.prepare(config, opened)
        summary, _ = run_job(job, run, opened, progress=bool(progress))
    return summary


__all__ = ["FinetuneConfig", "FinetuneJob", "Trainer", "identity_hash", "resolve_finetune", "run_finetune"]


# ---------------------------------------------------------------- speed: a local epoch against the bare model


def finetune_speed(encoder: str, *, weights: str | None = None, pretrained: bool = True, image_size: int | None = None,
                   pefts: tuple = ("lora", "full"), batch_size: int = 64, batches: int = 10, device: str = "auto",
                   precision: str = "auto", repeat: int = 3) -> list[dict]:  # fmt: skip
    """Images per second of a client's local epoch (:meth:`Trainer.train_client`: uint8 images indexed and
    normalised per batch, forward, backward, optimiser step, on the shared encoder) against the bare model's forward
    and backward on the same batches already normalised in memory (no data path, no optimiser), per ``--peft``
    kind; the best of ``repeat`` timed passes after one warm-up each."""
    dev = resolve_device(device)
    enc = load_encoder(encoder, weights=weights, pretrained=pretrained, image_size=image_size)
    s, n = enc.preprocessing.image_size, batch_size * batches
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, s, s, 3), dtype=torch.uint8, generator=gen).to(dev)
    y = torch.randint(0, 10, (n,), generator=gen).to(dev)
    rows = []
    for peft in pefts:
        cfg = resolve_finetune(FinetuneConfig(dataset="digits", data_dir=None, encoder=encoder, peft=peft,
                                              batch_size=batch_size, device=device, precision=precision))  # fmt: skip
        model, tuning = build_model(cfg, fresh(enc), 10, 0)
        model.to(dev)
        if dev.type == "cuda":
            model.to(memory_format=torch.channels_last)
        trainer = Trainer(cfg, enc, model, tuning, dev)
        times = _local_and_bare(trainer, x, y, repeat)
        theta = trainable_vector(model)
        rows.append({"encoder": encoder, "peft": peft, "image_size": s, "batch_size": batch_size, "images": n,
                     "device": str(dev), "precision": "bf16" if dev.type == "cuda" and precision != "fp32" else
                     precision if precision != "auto" else "fp32", "trainable": int(theta.numel()),
                     "local_images_per_s": times["local"], "bare_images_per_s": times["bare"],
                     "ratio": times["local"] / times["bare"]})  # fmt: skip
    return rows


def _local_and_bare(trainer: Trainer, x: torch.Tensor, y: torch.Tensor, repeat: int) -> dict:
    """Images/s of a local epoch and of the bare forward+backward over the same batches (best of ``repeat``)."""
    model, dev, b, n = trainer.model, trainer.device, trainer.cfg.batch_size, len(y)
    theta = trainable_vector(model)
    inputs = [normalise(x[i : i + b], trainer.enc, trainer.channels_last) for i in range(0, n, b)]

    def local() -> None:
        trainer.train_client(theta, x, y, 1)

    def bare() -> None:
        trainer._set_train_mode()  # the modes the local epoch trains in (frozen normalisation statistics)
        for i, inp in enumerate(inputs):
            with autocast(dev, trainer.cfg.precision):
                loss = torch.nn.functional.cross_entropy(model(inp).float(), y[i * b : (i + 1) * b])
            loss.backward()
        model.zero_grad(set_to_none=True)

    times = {}
    for name, fn in (("bare", bare), ("local", local)):
        fn()  # warm-up (cuDNN plans, the allocator)
        best = float("inf")
        for _ in range(repeat):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        times[name] = n / best
    return times
