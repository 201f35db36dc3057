"""``fedhead extract``, ``fedhead import`` and ``fedhead info``: thin typer wrappers over extract.run /
extract.importer / extract.store."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from extract.engines import ENGINES, RAY_CONNECT_TIMEOUT_S, extract
from extract.importer import import_features
from extract.store import open_store
from fedhead.infra.console import stdout_console
from fedhead.infra.exits import cli_errors


@cli_errors
def extract_cmd(
    dataset: str = typer.Option(
        ...,
        "--dataset",
        help="cifar10, cifar100, mnist, fashion-mnist, tinyimagenet, imagefolder, digits, or a format: webdataset, "
        "parquet, hf-disk, filelist.",
    ),
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", help="Dataset folder, or a filelist's .csv/.jsonl (not needed for digits)."
    ),
    encoder: str = typer.Option(..., "--encoder", help="timm model name or clip:MODEL/PRETRAINED."),
    weights: Optional[str] = typer.Option(
        None,
        "--weights",
        help="Local checkpoint file (timm, open_clip or "
        "EfficientNet-PyTorch format); 'registry' = installed weights package.",
    ),
    pretrained: bool = typer.Option(
        True, "--pretrained/--no-pretrained", help="--no-pretrained: random init (seed 0), for tests."
    ),
    image_size: Optional[int] = typer.Option(
        None, "--image-size", help="Input resolution (default: the encoder's own)."
    ),
    batch_size: int = typer.Option(64, "--batch-size"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    precision: str = typer.Option("fp32", "--precision", help="fp32, bf16 or fp16 (autocast)."),
    limit: Optional[int] = typer.Option(
        None, "--limit", help="Keep N images per split (seeded class-stratified selection)."
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Store path (default cache/<dataset>/<encoder>[-<size>].h5)."
    ),
    dtype: str = typer.Option("float16", "--dtype", help="float16 or float32 features."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing store made by another request."),
    download: bool = typer.Option(False, "--download", help="Download torchvision datasets if missing."),
    num_workers: Optional[int] = typer.Option(None, "--num-workers", help="DataLoader workers for image files."),
    skip_corrupt: bool = typer.Option(
        False,
        "--skip-corrupt",
        help="Leave out image files that cannot be decoded "
        "(truncated, not an image) instead of stopping; the store lists them under "
        "skipped/<split>.",
    ),
    client_folders: bool = typer.Option(
        False,
        "--client-folders",
        help="Natural clients: the image folder is train/<client>/<class>/<file> (recorded per training image, "
        "for --partition natural).",
    ),
    clients_csv: Optional[Path] = typer.Option(
        None, "--clients-csv", help="Natural clients from a CSV of rows 'file,client' (file relative to --data-dir)."
    ),
    client_pattern: Optional[str] = typer.Option(
        None,
        "--client-pattern",
        help="Natural clients from each training file's name (webdataset: record key): a regex with a group "
        "'client', e.g. '^(?P<client>[^_]+)_'.",
    ),
    client_column: Optional[str] = typer.Option(
        None, "--client-column", help="Natural clients from a column (parquet, hf-disk, filelist)."
    ),
    train_shards: Optional[str] = typer.Option(
        None,
        "--train-shards",
        help="webdataset/parquet: the training shards, a path, glob or brace pattern "
        "('shards/train-{000000..000009}.tar'); instead of --data-dir.",
    ),
    test_shards: Optional[str] = typer.Option(None, "--test-shards", help="The test shards, as --train-shards."),
    image_column: Optional[str] = typer.Option(
        None, "--image-column", help="parquet/hf-disk: image bytes column (default image); filelist: path column."
    ),
    label_column: Optional[str] = typer.Option(
        None, "--label-column", help="The label column (default label; webdataset: the .json field)."
    ),
    processes: int = typer.Option(
        1,
        "--processes",
        help="Encode in N processes on this machine (torch's elastic launcher, one GPU or a share of the cores "
        "each); under torchrun the ranks come from torchrun. The store equals a one-process run's.",
    ),
    engine: str = typer.Option(
        "local", "--engine", help=f"{' or '.join(ENGINES)}: ranks on this machine, or Ray Data actors (--processes)."
    ),
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help=f"A Ray cluster's HOST:PORT (--engine ray); it must answer within {RAY_CONNECT_TIMEOUT_S:g} s. "
        "Default: a Ray instance on this machine.",
    ),
    shard_images: Optional[int] = typer.Option(
        None,
        "--shard-images",
        help="Source images per shard (rounded up to whole batches; default 4096): each shard writes its own part, "
        "and a re-run encodes only the shards without one.",
    ),
    threads: Optional[int] = typer.Option(
        None,
        "--threads",
        help="CPU threads per process (default: the idle cores, divided among the processes). Features are "
        "bit-equal between runs with the same thread count.",
    ),
) -> None:
    """Encode a dataset with a frozen encoder into an HDF5 feature store (resumable)."""
    path = extract(
        dataset,
        data_dir,
        encoder,
        weights=weights,
        pretrained=pretrained,
        image_size=image_size,
        batch_size=batch_size,
        device=device,
        precision=precision,
        limit=limit,
        out=out,
        dtype=dtype,
        overwrite=overwrite,
        download=download,
        num_workers=num_workers,
        skip_corrupt=skip_corrupt,
        client_folders=client_folders,
        clients_csv=clients_csv,
        client_pattern=client_pattern,
        processes=processes,
        engine=engine,
        ray_address=ray_address,
        shard_images=shard_images,
        threads=threads,
        client_column=client_column,
        train_shards=train_shards,
        test_shards=test_shards,
        image_column=image_column,
        label_column=label_column,
    )
    stdout_console().print(str(path), soft_wrap=True)


@cli_errors
def info_cmd(store: Path = typer.Argument(..., help="A feature store written by 'fedhead extract'.")) -> None:
    """Print a feature store's metadata and shapes."""
    stdout_console().print(info_table(open_store(store, "STORE", check_values=True)), soft_wrap=True)


def info_table(info):
    """A rich table of a StoreInfo: shapes first, then every attribute (JSON values pretty-printed)."""
    import json

    from rich.table import Table

    t = Table(title=str(info.path), show_header=True)
    t.add_column("key", style="bold")
    t.add_column("value", overflow="fold")
    for k, shape in info.shapes.items():
        t.add_row(k, " x ".join(str(s) for s in shape))
    names = ", ".join(info.class_names)
    t.add_row("class_names", f"{info.num_classes}: {names[:200]}{'...' if len(names) > 200 else ''}")
    if info.client_names:
        names = ", ".join(info.client_names)
        t.add_row("client_names", f"{len(info.client_names)}: {names[:200]}{'...' if len(names) > 200 else ''}")
    for split, paths in info.skipped.items():
        more = f" ... ({len(paths)} in all)" if len(paths) > 3 else ""
        t.add_row(f"skipped/{split}", ", ".join(paths[:3]) + more)
    for k in sorted(info.attrs):
        v = info.attrs[k]
        if k == "request":
            continue
        t.add_row(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    return t


@cli_errors
def import_cmd(
    out: Path = typer.Option(..., "--out", help="The store to write (.h5)."),
    train: Optional[Path] = typer.Option(
        None,
        "--train",
        help="Training features: X.npy [N, D], a Parquet file with an embedding column, or a "
        "clip-retrieval output folder (img_emb/ + metadata/).",
    ),
    train_labels: Optional[Path] = typer.Option(
        None, "--train-labels", help="Training labels: y.npy [N], or a Parquet/CSV table (--label-column), row-aligned."
    ),
    test: Optional[Path] = typer.Option(None, "--test", help="Test features, as --train."),
    test_labels: Optional[Path] = typer.Option(None, "--test-labels", help="Test labels, as --train-labels."),
    npz: Optional[Path] = typer.Option(None, "--npz", help="One .npz holding both splits (instead of --train/--test)."),
    keys: str = typer.Option("x_train,y_train,x_test,y_test", "--keys", help="The --npz arrays' names, in that order."),
    embedding_column: str = typer.Option("embedding", "--embedding-column", help="Parquet: the embedding column."),
    label_column: str = typer.Option("label", "--label-column", help="Parquet/CSV: the label column."),
    clients: Optional[str] = typer.Option(
        None,
        "--clients",
        help="Natural clients: the training table's column (the --npz array; with .npy labels a "
        ".npy file) of each training row's client, for --partition natural.",
    ),
    class_names: Optional[Path] = typer.Option(None, "--class-names", help="A text file of class names, one a line."),
    name: Optional[str] = typer.Option(None, "--name", help="The store's dataset name (default: the file's stem)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 (exact) or float16 features."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an --out that holds other features."),
) -> None:
    """Turn features made elsewhere (.npy, .npz, Parquet, a clip-retrieval output folder) into a feature store with a
    content hash.

    Refuses in one line, writing nothing: row counts that differ, NaN/inf, object arrays, a missing column or array
    (listing those present), test labels that are no training class, feature dimensions that differ."""
    path = import_features(
        out,
        train=train,
        train_labels=train_labels,
        test=test,
        test_labels=test_labels,
        npz=npz,
        keys=keys,
        embedding_column=embedding_column,
        label_column=label_column,
        clients=clients,
        class_names=class_names,
        name=name,
        dtype=dtype,
        overwrite=overwrite,
    )
    stdout_console().print(str(path), soft_wrap=True)
