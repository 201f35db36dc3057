"""Result tables on stdout: one row per run summary, mean +- std where several seeds ran."""

from __future__ import annotations

TEXT_COLUMNS = ("run", "head", "partition", "recipe", "settings that differ")  # left-aligned; numbers right


def results_table(title: str, rows: list[dict], columns: list[tuple[str, str]]):
    """A rich table of result rows; ``columns`` are (key, header); ``key_std`` shown as +- when present."""
    from rich.table import Table

    t = Table(title=title)
    for _, h in columns:
        t.add_column(h, justify="left" if h in TEXT_COLUMNS else "right")
    for r in rows:
        cells = []
        for k, _ in columns:
            v = r.get(k)
            s = r.get(k + "_std")
            if isinstance(v, float) and "round" in k and v.is_integer() and not s:
                cells.append(str(int(v)))
            elif isinstance(v, float):
                cells.append(f"{v:.4f}" + (f" ± {s:.4f}" if isinstance(s, float) and s > 0 else ""))
            else:
                cells.append("" if v is None else str(v))
        t.add_row(*cells)
    return t


SUMMARY_COLUMNS = [
    ("head", "head"),
    ("partition", "partition"),
    ("final_accuracy", "final acc"),
    ("selected_round", "selected round"),
    ("val_accuracy", "val acc"),
    ("test_accuracy_at_selected", "test acc @ selected"),
    ("acc95_round", "Acc@95 round"),
    ("central_accuracy", "central acc"),
    ("final_ratio_to_central", "ratio to central"),
    ("final_ratio_to_iid", "ratio to IID"),
    ("client_ms", "client ms"),
    ("server_ms", "server ms"),
    ("wall_seconds", "wall s"),
]
