"""A synthetic shop of weak signal, for the loop's safety drills where the traffic says little: the served
lists' AUC near 0.57, where twenty lists a side cannot tell an inverted ranker from an honest one.

Writes a dataset spec and its files into a directory (nothing of the platform is edited for it) and prints
the oracle's mean list AUC (the true order probabilities as the scores): the best any ranker can do.

    .venv/bin/python -m benchmarks.shop /tmp/shop
    .venv/bin/flywheel demo --dataset /tmp/shop/dataset.toml

The shop: `products` products of `brands` brands, `customers` customers each with a favourite brand, a
visit a day with probability `visit_rate` over `days` days, `shown` products viewed per visit (drawn
uniformly). A viewed product is ordered with probability base x q_i x (lift if the customer's brand),
q_i lognormal of sd `quality_sd` (the products' appeal, which item counts reveal) and carted first 40 % of
the time. With the defaults the oracle's list AUC is ~0.61.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from models.metrics import auc

SPEC = """\
# A synthetic shop of weak signal (benchmarks/shop.py): views are the exposures, orders the label.
[dataset]
name = "weak-shop"

[events]
key = "brand"

[[events.types]]
name = "view"
role = "exposure"

[[events.types]]
name = "cart"
role = "positive"
weight = 2

[[events.types]]
name = "order"
role = "positive"
weight = 5
label = true

[events.history]
source = "events.csv"
user = "customer"
item = "sku"
type = "action"
time = "at"
time_unit = "s"
request = "visit"
context = ["brand"]

[features]
windows = ["1h", "1d"]

[tables.item]
source = "products.csv"
id = "sku"
category = "brand"

[tables.item.attributes.brand]
kind = "categorical"

[tables.item.attributes.price]
kind = "number"
scale = 0.01

[tables.user]
source = "customers.csv"
id = "customer"

[tables.user.attributes.region]
kind = "categorical"
"""

START = datetime(2025, 3, 3, tzinfo=UTC)


@dataclass(frozen=True)
class Shape:
    products: int = 2000
    brands: int = 40
    customers: int = 3000
    days: int = 14
    visit_rate: float = 0.5
    shown: int = 10
    base: float = 0.06  # a view's order probability at q = 1, not the customer's brand
    quality_sd: float = 0.35
    lift: float = 1.6  # the customer's favourite brand
    seed: int = 7


def write(root: Path, shape: Shape = Shape()) -> dict[str, float]:
    """The spec and its files under `root`; returns the history's counts and the oracle's list AUC."""
    rng = np.random.default_rng(shape.seed)
    root.mkdir(parents=True, exist_ok=True)
    skus = np.array([f"p{n:05d}" for n in range(shape.products)])
    brand_of = rng.integers(0, shape.brands, shape.products)
    quality = np.exp(rng.normal(0.0, shape.quality_sd, shape.products))
    favourite = rng.integers(0, shape.brands, shape.customers)
    customers = np.array([f"c{n:05d}" for n in range(shape.customers)])
    visits = [(c, d) for c in range(shape.customers) for d in range(shape.days) if rng.random() < shape.visit_rate]
    rows, oracle = [], []
    for c, d in sorted(visits, key=lambda v: (v[1], v[0])):
        at = int(START.timestamp()) + d * 86_400 + int(rng.integers(8 * 3600, 22 * 3600))
        shown = rng.choice(shape.products, shape.shown, replace=False)
        p = np.minimum(shape.base * quality[shown] * np.where(brand_of[shown] == favourite[c], shape.lift, 1.0), 1.0)
        ordered = rng.random(shape.shown) < p
        visit = f"{customers[c]}-{d}"
        for k, (i, buy) in enumerate(zip(shown, ordered)):
            t, brand = at + 10 * k, f"b{brand_of[i]:02d}"
            rows.append((customers[c], skus[i], "view", t, visit, brand))
            if buy:
                if rng.random() < 0.4:
                    rows.append((customers[c], skus[i], "cart", t + 2, visit, brand))
                rows.append((customers[c], skus[i], "order", t + 5, visit, brand))
        if 0 < ordered.sum() < shape.shown:
            oracle.append(auc(ordered.astype(float), p))
    events = pd.DataFrame(rows, columns=["customer", "sku", "action", "at", "visit", "brand"])
    events.to_csv(root / "events.csv", index=False)
    pd.DataFrame({"sku": skus, "brand": [f"b{b:02d}" for b in brand_of],
                  "price": np.round(rng.uniform(1, 120, shape.products), 2)}).to_csv(root / "products.csv", index=False)
    pd.DataFrame({"customer": customers, "region": [f"r{f % 5}" for f in favourite]}).to_csv(
        root / "customers.csv", index=False)
    (root / "dataset.toml").write_text(SPEC)
    counts = events["action"].value_counts()
    return {"visits": len(visits), "views": int(counts.get("view", 0)), "orders": int(counts.get("order", 0)),
            "judged_visits": len(oracle), "oracle_list_auc": float(np.mean(oracle))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory the spec and its files are written to")
    for name, default in vars(Shape()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    shape = Shape(**{k: getattr(args, k) for k in vars(Shape())})
    figures = write(args.out, shape)
    print(f"wrote {args.out / 'dataset.toml'}: {figures['visits']:,} visits, {figures['views']:,} views, "
          f"{figures['orders']:,} orders")
    print(f"shop: oracle list AUC {figures['oracle_list_auc']:.3f} on {figures['judged_visits']:,} judged visits")


if __name__ == "__main__":
    main()
