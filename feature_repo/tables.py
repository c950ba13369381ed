"""The spec's item and user tables read from their files, apart from the store (no Feast import: the
CLI's preflight checks the headers in a fraction of a second before any service starts).
"""

from __future__ import annotations

from infra.dataset import TableSpec
from infra.settings import Settings
from streaming.adapters import source_path
from streaming.history import cell_value, read_source, source_columns
from streaming.movielens import dataset_dir, load_side_table


class CatalogError(ValueError):
    """A table that does not match its spec; nothing of it was written."""


def _source(s: Settings, table: TableSpec) -> list[dict]:
    if table.source == "movielens":
        return load_side_table(dataset_dir(s) / f"ml-100k.{table.entity}")
    path = source_path(s, table.source)
    try:
        return read_source(path, [table.id]).to_pylist()
    except ValueError:
        raise CatalogError(f"{s.spec.path} [tables.{table.entity}] source: expected \"movielens\" or a .csv or "
                           f".parquet file, got {table.source!r}") from None


def _absent(s: Settings, table: TableSpec, present: set[str], empty: str = "no rows") -> None:
    missing = [c for c in dict.fromkeys([table.id, *(a.column for a in table.attributes)]) if c not in present]
    if missing:
        raise CatalogError(f"{s.spec.path} [tables.{table.entity}]: the table ({table.source}) has no column "
                           f"{', '.join(map(repr, missing))} (it has: {', '.join(sorted(present)) or empty})")


def check_tables(s: Settings) -> None:
    """Each table file has the columns the spec names (its header only: a preflight before any service
    starts); CatalogError, in one line, if not."""
    for table in s.spec.tables:
        if table.source == "movielens":
            continue
        try:
            present = source_columns(source_path(s, table.source))
        except (OSError, ValueError) as exc:
            raise CatalogError(f"{s.spec.path} [tables.{table.entity}] source: {exc}") from None
        _absent(s, table, set(present), "no columns")


def catalog_rows(s: Settings, table: TableSpec) -> list[dict]:
    """The table's rows as its view's (id and one feature per attribute), or CatalogError when a declared
    column is not in it."""
    rows = _source(s, table)
    _absent(s, table, set(rows[0]) if rows else set())
    key = f"{table.entity}_id"
    return [{key: str(r[table.id]), **{table.feature(a): cell_value(a, r[a.column]) for a in table.attributes}}
            for r in rows]
