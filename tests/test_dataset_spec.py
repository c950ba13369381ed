"""The dataset spec: a company's own event vocabulary is declared in one file, and a wrong spec is refused
before anything starts, with the file, the key and what was expected."""

import json
import re
from datetime import UTC, date, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from infra.dataset import SpecError, parse_spec
from infra.settings import Settings, SettingsError, load_settings
from streaming.events import InvalidEvent, decode

SHOP = """
[dataset]
name = "shop"

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
weight = 5.0
label = true

[tables.item]
source = "products.csv"
id = "sku"

[tables.item.attributes.brand]
kind = "categorical"

[tables.item.attributes.price]
kind = "number"
scale = 0.01
tokens = "decade"

[tables.item.attributes.tags]
kind = "multi"
separator = "|"

[tables.user]
source = "customers.parquet"
id = "customer"

[tables.user.attributes.region]
kind = "categorical"
column = "home_region"
"""


def shop(tmp_path: Path, text: str = SHOP) -> Path:
    path = tmp_path / "shop.toml"
    path.write_text(text)
    return path


def test_the_default_spec_is_movielens_and_every_role_derives_from_it() -> None:
    spec = load_settings({"FLYWHEEL_CONFIG": "/dev/null"}).spec
    assert spec.name == "movielens-100k"
    assert spec.type_names == ("impression", "click", "add_to_cart", "purchase")
    assert (spec.exposures, spec.labels) == (("impression",), ("click",))
    assert spec.weights == {"click": 1.0, "add_to_cart": 2.0, "purchase": 4.0}


def test_a_shop_declares_its_own_events(tmp_path: Path) -> None:
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path))})
    spec = s.spec
    assert spec.type_names == ("view", "cart", "order")
    assert (spec.exposures, spec.positives, spec.labels) == (("view",), ("cart", "order"), ("order",))
    assert spec.weights == {"cart": 2.0, "order": 5.0}
    record = {"schema_version": 1, "event_id": "e1", "user_id": "u1", "item_id": "sku-9", "event_type": "order",
              "request_id": "r1", "event_time": 1_700_000_000_000, "context": {}}
    assert decode(json.dumps(record).encode(), 10_000, spec.type_names).event_type == "order"
    with pytest.raises(InvalidEvent) as err:
        decode(json.dumps(record | {"event_type": "click"}).encode(), 10_000, spec.type_names)
    assert err.value.reason == "unknown event_type 'click' (declared: view, cart, order)"


def test_the_events_key_is_declared(tmp_path: Path) -> None:
    """Where it leads (the JVM's parser, the training labels) is tested on a stack: tests/test_onboarding.py."""
    movielens = load_settings({"FLYWHEEL_CONFIG": "/dev/null"})
    assert movielens.spec.key == "category"  # the default: MovieLens' events carry context.category
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(
        shop(tmp_path, SHOP.replace("[[events.types]]", '[events]\nkey = "brand"\n\n[[events.types]]', 1)))})
    assert s.spec.key == "brand"
    assert s.spec.digest != parse_spec(SHOP, s.spec.path).digest  # another key: another dataset to a stack


def test_several_grouping_keys_each_have_their_counts_interest_and_ranker_inputs(tmp_path: Path) -> None:
    """A shop groups by brand and by tag: each further key is an item attribute with per (user, value) counts,
    an interest histogram, a Feast entity of its own and two ranker inputs, its shares of the user's exposures
    and interest, computed alike for a training frame and a request's rows."""
    import subprocess
    import sys

    spec = shop(tmp_path, SHOP.replace("[[events.types]]", '[events]\nkey = ["brand", "tags"]\n\n[[events.types]]', 1))
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec)})
    assert (s.spec.key, s.spec.group_by, s.spec.keys) == ("brand", ("tags",), ("brand", "tags"))
    one_key = SHOP.replace("[[events.types]]", '[events]\nkey = "brand"\n\n[[events.types]]', 1)
    assert s.spec.digest != parse_spec(one_key, spec).digest
    code = """
import json, numpy as np
from streaming.features import STREAM_VIEWS
from feature_repo.definitions import ENTITIES
from contract.inputs import NUMERIC_FEATURES, RAW_FEATURES
from contract.transform import to_examples
views = {v.name: [v.keys, [c for c, _ in v.columns]] for v in STREAM_VIEWS if "tags" in v.name}
def rows(n):  # a user's values as the online store holds them: one object shared by the request's rows
    interest, weights = ["new", "sale"], [3.0, 1.0]
    return {"user_id": ["u"] * n, "item_id": ["A1", "B2", "C3"][:n], "category": ["acme", "zeta", ""][:n],
            "tags": ["new", "sale", ""][:n], "tags_impressions": [6, 2, None][:n], "user_impressions_total": [8] * n,
            **{f: [interest if f.endswith("values") else weights] * n for f in ("interest_tags_values",
               "interest_tags_weights")}}
cols = {f: [None] * 3 for f in RAW_FEATURES} | rows(3)
ex = to_examples(cols, np.zeros(3), np.zeros(3), 4)
shares = {n: ex.numeric[:, NUMERIC_FEATURES.index(n)].round(3).tolist() for n in ("tags_share", "interest_tags_share")}
print(json.dumps([views, sorted(ENTITIES), "tags_ctr" in NUMERIC_FEATURES, shares]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec), "PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr
    views, entities, counted, shares = json.loads(out.stdout)
    assert views == {"user_tags": [["user_id", "tags"], ["tags_impressions", "tags_clicks", "tags_ctr"]],
                     "user_tags_interest": [["user_id"], ["interest_tags_values", "interest_tags_weights"]]}
    assert "tags" in entities and counted
    assert shares == {"tags_share": [0.75, 0.25, 0.0], "interest_tags_share": [0.75, 0.25, 0.0]}


def test_the_stream_windows_are_declared_and_name_the_features(tmp_path: Path) -> None:
    import subprocess
    import sys

    assert load_settings({"FLYWHEEL_CONFIG": "/dev/null"}).spec.window_buckets == (("5m", 5, 5), ("1h", 60, 12))
    spec = shop(tmp_path, SHOP.replace("[tables.item]", '[features]\nwindows = ["1h", "7d"]\n\n[tables.item]', 1))
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec)})
    assert s.spec.window_buckets == (("1h", 60, 12), ("7d", 10080, 12))
    assert s.spec.digest != parse_spec(SHOP, spec).digest
    # A process of that spec: its stream views, Feast views and the ranker's inputs follow the windows.
    code = ("from streaming.features import STREAM_VIEWS; from contract.inputs import COUNTS; "
            "print([v.name for v in STREAM_VIEWS if v.name.startswith('user_')][:3], COUNTS[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec), "PATH": "/usr/bin"})
    assert out.stdout.strip() == ("['user_1h', 'user_7d', 'user_total'] "
                                  "('user_impressions_1h', 'user_clicks_1h', 'user_impressions_7d')")


def test_a_version_records_its_terms_and_a_server_refuses_terms_it_cannot_meet() -> None:
    from contract.terms import Terms, offered, unmet
    from models.ctr import ModelSpec

    have = offered()  # MovieLens' spec and the stream views
    spec = ModelSpec(numeric_features=have.numeric_features[:3])
    assert spec.terms.dataset == "movielens-100k" and unmet(spec.terms) == []  # any subset of the inputs
    assert ModelSpec.from_json(spec.to_json()).terms == spec.terms
    shop_terms = Terms("shop", ("view", "cart", "order"), ("user_region_share",), ("item_tokens:brand",))
    assert unmet(shop_terms) == [
        "trained on event types ['view', 'cart', 'order'] (dataset shop), the stream's are "
        "['impression', 'click', 'add_to_cart', 'purchase'] (dataset movielens-100k)",
        "expects numeric features the online features do not hold: ['user_region_share']",
        "expects attribute tokens the catalog does not declare: ['item_tokens:brand']"]
    legacy = json.loads(spec.to_json())
    del legacy["dataset"], legacy["tokens"]  # exported before the terms: not checked
    assert unmet(ModelSpec.from_json(json.dumps(legacy)).terms) == []
    assert shop_terms.digest != have.digest and len(have.digest) == 12


def test_a_model_keeps_the_vocabulary_it_was_trained_with() -> None:
    import numpy as np

    from models.ctr import CtrModel, ModelSpec
    from models.sparse import SparseConfig

    spec = ModelSpec(kind="logreg", sparse=SparseConfig(dim=1), jit_compile=False, event_types=("view", "cart", "order"))
    again = ModelSpec.from_json(spec.to_json())
    assert again.event_types == ("view", "cart", "order")
    model = CtrModel(again)
    ids = model._types(np.array([["order", "view", "click", ""]], dtype=object))
    assert ids.tolist() == [[3, 1, 0, 0]]  # a type the model was not trained with is unknown (0), not another's id
    legacy = json.loads(spec.to_json())
    del legacy["event_types"]  # exported before the spec: the configured spec's vocabulary
    assert ModelSpec.from_json(json.dumps(legacy)).event_types == ("impression", "click", "add_to_cart", "purchase")


@pytest.mark.parametrize("change, message", [
    (("[dataset]", "[datasets]"), "unknown key 'datasets' (expected: dataset, events, tables, features, demo, "
     "settings, scenarios, objectives, ranking)"),
    (('kind = "categorical"', 'kind = "text"'), "[tables.item].attributes.brand.kind: expected one of categorical"),
    (('kind = "categorical"', 'kind = "categorical"\nseparator = ","'), "brand.separator: only a multi attribute"),
    (('kind = "categorical"', 'kind = "categorical"\ntokens = "decade"'),
     "brand.tokens: expected value or none for a categorical attribute, got 'decade'"),
    (('tokens = "decade"', 'tokens = "value"'), "price.tokens: expected decade or none for a number attribute"),
    (("scale = 0.01", "scale = 0.01\norigin = -5"), "price.origin: expected a number >= 0, got -5"),
    (('kind = "categorical"', 'kind = "categorical"\nscale = 2'), "brand: origin and scale are for integer"),
    (('id = "sku"', 'key = "sku"'), "[tables.item]: unknown key 'key' (expected: source, id, attributes, category)"),
    (('id = "sku"', 'id = "sku"\ncategory = "price"'), "[tables.item].category: expected the name of a categorical"),
    (('id = "customer"', 'id = "customer"\ncategory = "region"'), "[tables.user]: unknown key 'category'"),
    (("[tables.user]", "[tables.shop]"), "[tables]: unknown key 'shop' (expected: item, user)"),
    (('name = "shop"', 'name = "shop"\nowner = "me"'), "[dataset]: unknown key 'owner' (expected: name, adapter)"),
    (('name = "shop"', ""), "[dataset]: missing key 'name'"),
    (('name = "shop"', "name = 7"), "[dataset].name: expected str, got int 7"),
    (('role = "exposure"', 'role = "seen"'), "#1.role: expected one of exposure, positive, negative, got 'seen'"),
    (('role = "exposure"', "role = true"), "#1.role: expected str, got bool"),
    (("weight = 2", 'weight = "2"'), "#2.weight: expected int or float, got str '2'"),
    (("weight = 2", "weight = 0"), "#2.weight: expected a number > 0 for a positive, got 0.0"),
    (("label = true", 'label = "yes"'), "#3.label: expected bool, got str 'yes'"),
    (("label = true", "label = false"), "expected at least one positive with label = true"),
    (('role = "exposure"', 'role = "positive"'), 'expected at least one type with role = "exposure"'),
    (('name = "cart"', 'name = "view"'), "the name 'view' is declared twice"),
    (('name = "cart"', 'name = "add to cart"'), "#2.name: expected a name of letters"),
    (('name = "view"\nrole = "exposure"', 'name = "view"\nrole = "exposure"\nlabel = true'),
     "an exposure has no weight and labels nothing"),
    (("[dataset]", "[dataset"), "not TOML"),
    (("[[events.types]]", '[events]\nkey = "the brand"\n\n[[events.types]]'), "[events].key: expected a context field"),
    (("[[events.types]]", '[events]\nkey = ["brand", "price"]\n\n[[events.types]]'),
     "[events].key: 'price' is not a categorical or multi attribute of [tables.item]"),
    (("[[events.types]]", '[events]\nkey = ["brand", "tags", "tags"]\n\n[[events.types]]'), "'tags' is named twice"),
    (("[[events.types]]", '[events]\nkey = ["brand", "user"]\n\n[[events.types]]'),
     "expected the keys after the first to be item attribute or context field names"),
    (("[tables.item]", '[features]\nwindows = ["5x"]\n\n[tables.item]'), "[features].windows: expected 1 to 4 windows"),
    (("[tables.item]", '[features]\nwindows = ["60m", "1h"]\n\n[tables.item]'), "a window is declared twice"),
    (("[tables.item]", '[features]\nwindow = ["1h"]\n\n[tables.item]'), "[features]: unknown key 'window'"),
    (("[tables.item]", '[demo]\nsplit = "soon"\n\n[tables.item]'), "[demo].split: expected a date such as"),
    (("[tables.item]", '[demo]\ntrain_days = 0\n\n[tables.item]'), "[demo].train_days: expected an integer >= 1"),
    (("[tables.item]", '[events.context.page]\nkind = "text"\n\n[tables.item]'),
     "[events.context].page.kind: expected categorical, bucketed, number, got 'text'"),
    (("[tables.item]", '[events.context.hour]\nkind = "bucketed"\n\n[tables.item]'),
     "[events.context].hour.buckets: expected the buckets' lower edges of a bucketed field"),
    (("[tables.item]", '[events.context.page]\nkind = "categorical"\nbuckets = [1]\n\n[tables.item]'),
     "[events.context].page.buckets: only a bucketed field has buckets, not a categorical one"),
    (("[tables.item]", '[events.context.hour]\nkind = "bucketed"\nbuckets = [12, 6]\n\n[tables.item]'),
     "[events.context].hour.buckets: expected 1 to 32 numbers, ascending, each once; got [12, 6]"),
    (("[tables.item]", '[events.context.hour]\nkind = "number"\ndefault = "noon"\n\n[tables.item]'),
     "[events.context].hour.default: expected a number, got str 'noon'"),
    (("[tables.item]", '[events.context.page]\nkind = "categorical"\ndefault = 3\n\n[tables.item]'),
     "[events.context].page.default: expected str, got int 3"),
    (("[tables.item]", '[events.context.Page]\nkind = "categorical"\n\n[tables.item]'),
     "[events.context]: expected a field name of lowercase letters"),
    (("[tables.item]", '[events.context.position]\nkind = "categorical"\n\n[tables.item]'),
     "[events.context].position: 'position' is a context field the platform reads or writes itself"),
    (("[tables.item]", '[events]\nkey = ["brand", "tags"]\n[events.context.tags]\nkind = "categorical"\n\n'
                       '[tables.item]'),
     "[events].key: 'tags' is both an attribute of [tables.item] and a field of [events.context]: rename one"),
    (("[tables.item]", '[events]\nkey = "brand"\n[events.context.brand]\nkind = "categorical"\n\n[tables.item]'),
     "[events.context].brand: 'brand' is the first grouping key"),
    (("[tables.item]", '[events]\nkey = ["brand", "hour"]\n[events.context.hour]\nkind = "number"\n\n[tables.item]'),
     "[events].key: 'hour' is a number context field: a key's values are categorical"),
    (("[tables.item]", '[events]\nkey = ["brand", "page"]\n[events.context.page]\nkind = "categorical"\n'
                       'default = "a,b"\n\n[tables.item]'),
     "[events].key: 'page''s default is the stream job's too: expected none of | , : ' \" in it, got 'a,b'"),
    (("[tables.item]", '[events.context.region]\nkind = "categorical"\n\n[tables.item]'),
     "[events.context].region: 'region' is also an attribute's token prefix"),
    (("[tables.item]", '[events.position]\nslots = 1\n\n[tables.item]'),
     "[events.position].slots: expected an integer from 2 to 100, got 1"),
    (("[tables.item]", '[events.position]\nslots = "10"\n\n[tables.item]'),
     "[events.position].slots: expected int, got str '10'"),
    (("[tables.item]", '[events.position]\nfield = "rank"\n\n[tables.item]'),
     "[events.position]: unknown key 'field' (expected: slots)"),
])
def test_a_wrong_spec_is_refused_with_the_file_the_key_and_what_was_expected(
        tmp_path: Path, change: tuple[str, str], message: str) -> None:
    path = shop(tmp_path, SHOP.replace(*change, 1))
    with pytest.raises(SpecError) as err:
        parse_spec(path.read_text(), path)
    assert str(path) in str(err.value) and message in str(err.value)
    with pytest.raises(SettingsError, match="^dataset.spec: "):  # before anything starts: settings refuse it
        load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(path)})


def test_the_demo_cut_is_declared_as_a_date_and_an_unknown_adapter_is_named(tmp_path: Path) -> None:
    from streaming.adapters import source_path

    demo = "[demo]\nsplit = 2025-03-08\ntrain_days = 5\n\n[tables.item]"
    path = shop(tmp_path, SHOP.replace("[tables.item]", demo, 1))
    demo = parse_spec(path.read_text(), path).demo
    assert (demo.split, demo.train_days) == (datetime(2025, 3, 8, tzinfo=UTC), 5)
    path = shop(tmp_path, SHOP.replace('name = "shop"', 'name = "shop"\nadapter = "nowhere"', 1))
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(path)})
    with pytest.raises(SpecError, match="unknown adapter 'nowhere' \\(bundled: instacart, world\\)"):
        source_path(s, "history.csv")


def test_a_missing_spec_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="nowhere.toml: cannot read the dataset spec"):
        load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(tmp_path / "nowhere.toml")})


def test_a_stack_holding_one_dataset_refuses_another_spec(tmp_path: Path) -> None:
    from infra.stack import StackError, check_dataset, dataset_record

    base = {"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")}
    movielens = load_settings(base)
    check_dataset(movielens)  # the first start records the spec
    check_dataset(movielens)  # and the same spec starts again
    other = load_settings(base | {"FLYWHEEL_DATASET_SPEC": str(shop(tmp_path))})
    with pytest.raises(StackError) as err:
        check_dataset(other)
    assert "holds data of dataset 'movielens-100k'" in str(err.value) and "paths.data_dir" in str(err.value)
    check_dataset(load_settings(base | {"FLYWHEEL_DATASET_SPEC": str(shop(tmp_path)),
                                        "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "shop-data")}))
    dataset_record(movielens).unlink()  # the documented way to accept a change the data can take
    check_dataset(other)


def test_a_shops_catalog_is_read_from_its_own_files_by_the_spec(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from feature_repo.tables import CatalogError, catalog_rows

    (tmp_path / "products.csv").write_text("sku,brand,price,tags,unused\nA1,acme,1999,new|sale,x\nB2,,250,,y\n")
    pq.write_table(pa.table({"customer": ["c1", "c2"], "home_region": ["north", None]}), tmp_path / "customers.parquet")
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path))})
    assert catalog_rows(s, s.spec.table("item")) == [
        {"item_id": "A1", "item_brand": "acme", "item_price": 1999.0, "item_tags": ["new", "sale"]},
        {"item_id": "B2", "item_brand": None, "item_price": 250.0, "item_tags": []}]
    assert catalog_rows(s, s.spec.table("user")) == [{"user_id": "c1", "user_region": "north"},
                                                      {"user_id": "c2", "user_region": None}]
    (tmp_path / "products.csv").write_text("sku,maker,price,tags\nA1,acme,1999,new\n")  # brand renamed
    with pytest.raises(CatalogError, match=r"\[tables.item\]: the table \(products.csv\) has no column 'brand' "
                                           r"\(it has: maker, price, sku, tags\)"):
        catalog_rows(s, s.spec.table("item"))

    # A wrong table is refused before any table is written: the items were fine, the users are not.
    from feature_repo.catalog import load_catalog
    from feature_repo.files import view_dir

    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\n")
    pq.write_table(pa.table({"customer": ["c1"], "region": ["north"]}), tmp_path / "customers.parquet")
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path)),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")})
    with pytest.raises(CatalogError, match="has no column 'home_region'"):
        load_catalog(s)
    assert not view_dir(s, "item_attributes").exists()


@pytest.mark.parametrize("row, reason", [
    ("c1,A1,view,yesterday", "row 2: time 'yesterday' is neither a timestamp nor a number of s since the epoch"),
    (f"{'c' * 200},A1,view,1700000000", "row 2: bad value: user_id must have 1..128 characters"),
    ("c1,A1,view,1700000000000", "row 2: bad value: event_time 1700000000000000 is not milliseconds"),  # ms as s
    ("c1,,view,1700000000", "row 2: no item (sku)"),
])
def test_a_history_file_is_checked_whole_before_its_first_event(tmp_path: Path, row: str, reason: str) -> None:
    from streaming.history import HistoryError, history_events

    spec = shop(tmp_path, SHOP.replace("[tables.item]", '[events.history]\nsource = "history.csv"\nuser = "customer"\n'
                                       'item = "sku"\ntype = "action"\ntime = "at"\ntime_unit = "s"\n\n[tables.item]'))
    (tmp_path / "history.csv").write_text(f"customer,sku,action,at\nc0,A1,view,1700000000\n{row}\n")
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec)})
    with pytest.raises(HistoryError, match=re.escape(f"history.csv {reason}")):
        next(history_events(s))  # not even the good first row is yielded


def test_a_history_without_exposures_is_replayed_with_sampled_ones(tmp_path: Path) -> None:
    """Orders only (no views): each order's items and 2x as many others, by popularity, are shown 1 ms
    before it in its request, so the ranker has exposures to learn from and the stream counts them: each with its
    item's key (a brand) and its request's context (the page, a context key too)."""
    from collections import Counter

    from streaming.history import history_events

    keyed = '[events]\nkey = ["brand", "page"]\n[events.context.page]\nkind = "categorical"\n\n[[events.types]]'
    spec = shop(tmp_path, SHOP.replace("[[events.types]]", keyed, 1).replace(
        "[tables.item]", '[events.history]\nsource = "orders.csv"\nuser = "customer"\nitem = "sku"\ntype = "action"\n'
        'time = "at"\ntime_unit = "s"\nrequest = "basket"\ncontext = ["brand", "page"]\nnegatives = 2\n\n'
        '[tables.item]'))
    rows = ["customer,sku,action,at,basket,brand,page"]
    for n in range(40):  # 40 baskets of two orders; p0 is in every basket (the most popular), p1..p20 in two
        page = ("home", "sale")[n % 2]
        rows += [f"c{n % 7},p0,order,{1_700_000_000 + 60 * n},b{n},acme,{page}",
                 f"c{n % 7},p{1 + n % 20},order,{1_700_000_000 + 60 * n + 5},b{n},b{n % 3},{page}"]
    rows.append("c1,p5,cart,1700009000,b99,b2,home")
    (tmp_path / "orders.csv").write_text("\n".join(rows) + "\n")
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec)})
    events = list(history_events(s))
    assert events == list(history_events(s))  # the same sample every replay
    shown = [e for e in events if e.event_type == "view"]
    assert Counter(e.event_type for e in events) == {"order": 80, "cart": 1, "view": 40 * 6 + 3}
    by_request: dict[str, list] = {}
    for e in events:
        by_request.setdefault(e.request_id, []).append(e)
    for request, its in by_request.items():
        acted = {e.item_id for e in its if e.event_type != "view"}
        views = [e for e in its if e.event_type == "view"]
        assert len(views) == 3 * len(acted) and len({e.item_id for e in views}) == len(views)  # each once
        assert acted <= {e.item_id for e in views}  # an order's item was shown in its request
        assert {e.event_time for e in views} == {min(e.event_time for e in its if e.event_type != "view") - 1}
        assert its[: len(views)] == views  # replayed first
        page = "home" if request == "b99" else ("home", "sale")[int(request[1:]) % 2]
        assert {e.context["page"] for e in its} == {page}  # the request's
    assert all(e.context["brand"] == "acme" for e in shown if e.item_id == "p0")  # the item's key travels
    assert len({e.event_id for e in events}) == len(events)


@pytest.mark.parametrize("broken, said", [
    ("history", "[events.history]: orders.csv has no column 'dept' (it has: customer, sku, action, at)"),
    ("catalog", "[tables.user]: the table (customers.parquet) has no column 'home_region' (it has: customer)"),
])
def test_the_demo_refuses_a_spec_its_files_do_not_match_before_any_service_starts(
        tmp_path: Path, broken: str, said: str) -> None:
    """A history or table without a column the spec names: `flywheel demo` (and for the history `flywheel
    replay`) says which in one line, with no service started and nothing produced."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from infra import stack
    from tests.conftest import run_cli, stack_environ

    spec = shop(tmp_path, SHOP.replace("[tables.item]", '[events.history]\nsource = "orders.csv"\nuser = "customer"\n'
                                       'item = "sku"\ntype = "action"\ntime = "at"\ntime_unit = "s"\n'
                                       f'context = [{"dept" if broken == "history" else ""!r}]\n\n[tables.item]')
               .replace("context = ['']", "context = []"))
    (tmp_path / "orders.csv").write_text("customer,sku,action,at\nc1,A1,view,1700000000\n")
    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\n")
    pq.write_table(pa.table({"customer": ["c1"], **({"home_region": ["north"]} if broken == "history" else {})}),
                   tmp_path / "customers.parquet")
    environ = stack_environ(tmp_path / "data", FLYWHEEL_DATASET_SPEC=str(spec))
    for command in (["demo"], ["replay"]) if broken == "history" else (["demo"],):
        done = run_cli(environ, *command, timeout=60)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert done.stderr.strip().splitlines()[-1] == f"Error: {spec} {said}", (command, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    s = load_settings(environ)
    assert {svc.state for svc in stack.status(s)} == {"stopped"}


def test_a_date_attribute_is_read_as_a_calendar_day_and_enters_the_ranker_as_its_age_at_the_request(
        tmp_path: Path) -> None:
    """A product's launch date: stored as days since the epoch from whatever the table holds (ISO text, a
    Parquet date or timestamp), and the ranker's input is how old the product is when it is shown, in years:
    the same function at training (the request's time) and serving (now)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from contract.transform import attribute_input
    from feature_repo.tables import catalog_rows

    spec = shop(tmp_path, SHOP.replace('[tables.item.attributes.tags]',
                                       '[tables.item.attributes.launched]\nkind = "date"\ncolumn = "launch"\n\n'
                                       '[tables.item.attributes.tags]'))
    (tmp_path / "products.csv").write_text("sku,brand,price,tags,launch\nA1,acme,1999,new,2024-01-01\n"
                                           "B2,,250,,2023-12-31T12:00:00+00:00\nC3,,1,,soon\nD4,,1,,17000\n")
    pq.write_table(pa.table({"customer": ["c1"], "region": ["north"]}), tmp_path / "customers.parquet")
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec)})
    launched = next(a for a in s.spec.table("item").attributes if a.name == "launched")
    assert (launched.numeric, launched.tokens, launched.scale) == (True, "none", 1 / 365.25)
    rows = {r["item_id"]: r["item_launched"] for r in catalog_rows(s, s.spec.table("item"))}
    jan1 = (datetime(2024, 1, 1, tzinfo=UTC) - datetime(1970, 1, 1, tzinfo=UTC)).days
    assert rows == {"A1": jan1, "B2": jan1 - 0.5, "C3": None, "D4": None}  # text and bare numbers: missing
    parquet = tmp_path / "products.parquet"
    pq.write_table(pa.table({"sku": ["A1"], "brand": ["acme"], "price": [1.0], "tags": ["x"],
                             "launch": pa.array([date(2024, 1, 1)], pa.date32())}), parquet)
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(
        tmp_path, spec.read_text().replace('"products.csv"', '"products.parquet"')))})
    assert catalog_rows(s, s.spec.table("item"))[0]["item_launched"] == jan1

    shown = np.array([datetime(y, m, 1, tzinfo=UTC).timestamp() * 1000 for y, m in ((2025, 1), (2023, 6), (2026, 1))])
    ages = attribute_input(launched, [jan1, jan1, None], shown)
    np.testing.assert_allclose(ages, [366 / 365.25, 0.0, 0.0])  # a year on; not launched yet; unknown
    with pytest.raises(SpecError, match=r"launched.tokens: expected none for a date attribute"):
        parse_spec(spec.read_text().replace('kind = "date"', 'kind = "date"\ntokens = "decade"'), spec)


def test_a_history_without_the_key_takes_each_items_from_the_catalog(tmp_path: Path, caplog) -> None:
    """Events rarely carry the item's category: the replay reads it from the item table (its category
    attribute), and replays the same events as a history that carried it; an item the catalog lacks keeps
    none, and is counted."""
    from streaming.history import history_events

    def replay(context: str, header: str, rows: list[str]) -> list:
        directory = tmp_path / (context.strip('"') or "none")  # a spec and its files of its own
        directory.mkdir()
        (directory / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\nB2,zeta,250,\nC3,,1,\n")
        spec = shop(directory, SHOP.replace("[[events.types]]", '[events]\nkey = "brand"\n\n[[events.types]]', 1).replace(
            "[tables.item]", '[events.history]\nsource = "orders.csv"\nuser = "customer"\nitem = "sku"\n'
            f'type = "action"\ntime = "at"\ntime_unit = "s"\nrequest = "basket"\ncontext = [{context}]\n\n[tables.item]'))
        (directory / "orders.csv").write_text("\n".join([header, *rows]) + "\n")
        return list(history_events(load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec)})))

    orders = [("c1", "A1", "view", 1_700_000_000, "b1"), ("c1", "A1", "order", 1_700_000_005, "b1"),
              ("c2", "B2", "view", 1_700_000_010, "b2"), ("c2", "C3", "view", 1_700_000_011, "b2"),
              ("c2", "Z9", "view", 1_700_000_012, "b2")]
    brands = {"A1": "acme", "B2": "zeta"}
    carried = replay('"brand"', "customer,sku,action,at,basket,brand",
                     [",".join(map(str, (*o, brands.get(o[1], "")))) for o in orders])
    with caplog.at_level("WARNING"):
        enriched = replay("", "customer,sku,action,at,basket", [",".join(map(str, o)) for o in orders])
    assert [e.context for e in enriched] == [{"brand": "acme"}, {"brand": "acme"}, {"brand": "zeta"}, {}, {}]
    assert enriched == carried  # the stream counts the same (user, brand) pairs either way
    assert "2 items the catalog does not know keep no brand (e.g. C3, Z9)" in caplog.text


def labelled(s: Settings, shown: list[tuple[str, dict]]) -> pd.DataFrame:
    """The training labels of a view and an order of each (item, context) shown to one user, each its own request."""
    from feature_repo.event_log import write_batch
    from models.dataset import Window, labelled_impressions
    from streaming.consumer import Consumed
    from streaming.events import Event

    t = 1_700_000_000_000
    events = [Event(event_id=f"{kind}-{n}", user_id="u", item_id=item, event_type=kind, request_id=f"r{n}",
                    event_time=t + 10 * n + (kind == "order"), context=context)
              for n, (item, context) in enumerate(shown) for kind in ("view", "order")]
    write_batch(s, [Consumed(e, partition=0, offset=n) for n, e in enumerate(events)])
    return labelled_impressions(s, Window(datetime.fromtimestamp(t / 1000, UTC),
                                          datetime.fromtimestamp(t / 1000 + 1, UTC)))


def test_live_events_without_the_key_take_the_catalogs_in_the_stream_jobs_file_and_the_training_labels(
        tmp_path: Path) -> None:
    """What the replay does for a history, the stream job (from write_item_keys' file: streaming/java ItemKeys)
    and the training labels do for live events: the item's key from the catalog, a carried one kept."""
    from streaming.history import ItemKeyFile, item_keys_path, write_item_keys

    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\nB2,zeta,250,\nC3,,1,\n")
    # a further key, tags (a multi attribute: its first tag), taken alike
    spec = shop(tmp_path, SHOP.replace("[[events.types]]", '[events]\nkey = ["brand", "tags"]\n\n[[events.types]]', 1))
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(spec),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")})
    reader = ItemKeyFile(item_keys_path(s), recheck_s=0)  # the ranking server's, for candidates without it
    assert reader.get("A1") == "" and not item_keys_path(s).exists()
    assert write_item_keys(s) == 2 and json.loads(item_keys_path(s).read_text()) == {"A1": ["acme", "new"],
                                                                                   "B2": ["zeta", None]}
    assert (reader.get("A1"), reader.get("B2"), reader.get("C3")) == ("acme", "zeta", "")
    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\nC3,cirrus,1,\n")  # a table loaded again
    write_item_keys(s)
    assert (reader.get("A1"), reader.get("B2"), reader.get("C3")) == ("acme", "", "cirrus")
    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\nB2,zeta,250,\n")
    write_item_keys(s)
    shown = [("A1", {}), ("B2", {"brand": "own"}), ("Z9", {}), ("B2", {"tags": "sale"})]  # Z9: not in the catalog
    rows = labelled(s, shown)
    assert list(rows["category"]) == ["acme", "own", "", "zeta"] and list(rows["label"]) == [1.0] * 4
    assert list(rows["tags"]) == ["new", "", "", "sale"]
    assert reader.values("A1") == ["acme", "new"] and reader.values("Z9") == [None]


PAGE = '[events.context.page]\nkind = "categorical"\ndefault = "home"\n[events.context.device]\nkind = "categorical"\n'


def test_a_declared_request_context_reaches_the_training_labels_with_its_defaults(tmp_path: Path) -> None:
    """The page a list was shown on, as each exposure carries it: a label row's input, the declared default where
    an event lacks it, values as a client may send them (a number, a boolean) read as one string each."""
    text = SHOP.replace("[tables.item]", PAGE + "\n[tables.item]", 1)
    spec = parse_spec(text, shop(tmp_path, text))
    assert [(c.name, c.kind, c.default) for c in spec.context] == [("page", "categorical", "home"),
                                                                  ("device", "categorical", "")]
    assert spec.digest != parse_spec(SHOP, shop(tmp_path)).digest
    assert spec.context_of({"page": 2.0, "device": True, "position": 3}) == {"page": "2", "device": "true"}
    assert spec.context_of(None) == {"page": "home", "device": ""}
    assert spec.undeclared_context({"page": "sale", "pgae": "x"}) == ["pgae"]
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")})
    rows = labelled(s, [("A1", {"page": "search", "device": "ios"}), ("B2", {"position": 1}), ("C3", {"page": 7})])
    assert list(rows["page"]) == ["search", "home", "7"] and list(rows["device"]) == ["ios", "", ""]


def test_a_context_field_as_a_key_is_counted_per_page_shown_and_read_with_the_requests(tmp_path: Path) -> None:
    """`key = ["brand", "page"]`, `page` a declared context field: the stream's per (user, page) counts and the
    ranker's page inputs group by the page a list was shown on, not by the item: the training labels take the
    exposure's page (its default where it lacks one, as the stream job counts it), a request's candidates are read
    with the request's page (the default where it names none)."""
    import subprocess
    import sys

    from streaming.history import item_keys_path, write_item_keys

    (tmp_path / "products.csv").write_text("sku,brand,price,tags\nA1,acme,1999,new\nB2,zeta,250,\n")
    text = SHOP.replace("[[events.types]]", '[events]\nkey = ["brand", "page"]\n\n[[events.types]]', 1).replace(
        "[tables.item]", PAGE + "\n[tables.item]", 1)
    environ = {"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
               "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")}
    s = load_settings(environ)
    assert (s.spec.group_by, s.spec.context_keys) == (("page",), ("page",))
    assert write_item_keys(s) == 2 and json.loads(item_keys_path(s).read_text()) == {"A1": ["acme", None],
                                                                                   "B2": ["zeta", None]}
    assert s.spec.key_default("page") == "home" and s.spec.key_default("brand") == ""  # the stream job's too
    rows = labelled(s, [("A1", {"page": "sale"}), ("B2", {}), ("A1", {"page": "search", "brand": "own"})])
    assert list(rows["page"]) == ["sale", "home", "search"] and list(rows.columns).count("page") == 1
    assert list(rows["category"]) == ["acme", "zeta", "own"]
    code = """
import json, sys, time
import serving.features as served
from contract.inputs import NUMERIC_FEATURES
from feature_repo.definitions import BATCH_VIEWS
from feature_repo.online import write_layout
from infra.settings import get_settings
from streaming.features import STREAM_VIEWS
s = get_settings()
s.paths.service_dir("feast").mkdir(parents=True)
write_layout(s, {served.SERVICE: [(v.keys, v.name, [c for c, _ in v.columns]) for v in (*STREAM_VIEWS, *BATCH_VIEWS)]})
counts = {("u", "sale"): 4, ("u", "home"): 8}
class Store:  # the online store: (user, page) impressions for two pages, nothing else
    asked = []
    def __init__(self, *args): pass
    def read_all(self, reads):
        Store.asked += [e for keys, entities, _ in reads if keys == ("user_id", "page") for e in entities]
        return [[tuple(counts.get(e) if f == "page_impressions" else None for _, f in refs) for e in entities]
                for _, entities, refs in reads]
served.OnlineReader = Store
class Item:
    def __init__(self, item_id): self.item_id, self.category = item_id, ""
features, of = served.OnlineFeatures(s), NUMERIC_FEATURES.index("page_impressions")
out = []
for context in ({"page": "sale"}, None, {"page": "cart"}):
    Store.asked = []
    ex = features.fetch("u", [Item("A1"), Item("B2")], int(time.time() * 1000), 4, context=context).examples
    out.append([Store.asked, [round(float(x), 3) for x in ex.numeric[:, of]]])
print(json.dumps(out))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=environ | {"PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr
    log4, log8 = round(float(np.log1p(4)), 3), round(float(np.log1p(8)), 3)
    assert json.loads(out.stdout) == [[[["u", "sale"]], [log4, log4]], [[["u", "home"]], [log8, log8]],
                                      [[["u", "cart"]], [0.0, 0.0]]]


KINDS = ('[events.context.band]\nkind = "bucketed"\nbuckets = [6, 12, 18.5]\n'
         '[events.context.hour]\nkind = "number"\ndefault = 12\n')


def test_a_bucketed_context_field_is_a_token_of_its_bucket_and_a_number_one_a_numeric_input(tmp_path: Path) -> None:
    """A bucketed field reads a number as its bucket's lower edge (the token "band:12"), a number field is the
    ranker's numeric input `context_<name>` (never a stored feature), each from the exposure's event in the
    training labels; a request's value of another type is refused, an event's is the default."""
    import subprocess
    import sys

    text = SHOP.replace("[tables.item]", KINDS + "\n[tables.item]", 1)
    spec = parse_spec(text, shop(tmp_path, text))
    band, hour = spec.context
    assert [band.value(x) for x in (3, 6, 13.5, 18.5, 40, None, "7", True)] == ["<6", "6", "12", "18.5", "18.5", "",
                                                                                "", ""]
    assert [hour.value(x) for x in (7, 7.5, None, "7", True)] == [7.0, 7.5, 12.0, 12.0, 12.0]
    assert [c.name for c in spec.mistyped_context({"band": "evening", "hour": 7})] == ["band"]
    assert [c.name for c in spec.mistyped_context({"band": 7, "hour": True})] == ["hour"]
    assert not spec.mistyped_context({})
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path / "data")})
    rows = labelled(s, [("A1", {"band": 19, "hour": 19}), ("B2", {}), ("C3", {"band": "x", "hour": 2.5})])
    assert list(rows["band"]) == ["18.5", "", ""] and list(rows["hour"]) == [19.0, 12.0, 2.5]
    code = ("from contract.inputs import NUMERIC_FEATURES, RAW_FEATURES; from contract.terms import token_prefixes; "
            "from contract.transform import _context_tokens; from models.train import model_spec; "
            "from infra.settings import load_settings; s = load_settings(); "
            "print(NUMERIC_FEATURES[-1], 'context_hour' in RAW_FEATURES, "
            "[t for t in token_prefixes() if 'context' in t], _context_tokens({'band': ['6', '']}, 2).tolist(), 'context_hour' in model_spec(s).numeric_features,"
            " 'context_hour' in model_spec(s, without=['hour']).numeric_features)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                              "PATH": "/usr/bin"})
    assert out.stdout.strip().splitlines()[-1] == ("context_hour False ['context_tokens:band'] [['band:6'], ['']] "
                                                   "True False"), out.stderr[-2000:]


def test_a_declared_position_reaches_the_training_labels_as_the_rank_shown_at(tmp_path: Path) -> None:
    """`[events.position]`: each exposure's rank in its list (the `position` the platform's traffic logs) is a label
    row's input; an event without one, or with no whole number >= 0, is at the top (no bias). Undeclared: not
    read. A new version learns its bias unless trained `--without position`."""
    text = SHOP.replace("[tables.item]", "[events.position]\n\n[tables.item]", 1)
    spec = parse_spec(text, shop(tmp_path, text))
    assert spec.position_slots == 10 and spec.digest != parse_spec(SHOP, shop(tmp_path)).digest
    four = text.replace("[events.position]", "[events.position]\nslots = 4")
    assert parse_spec(four, shop(tmp_path)).position_slots == 4
    shown = [("A1", {"position": 3}), ("B2", {}), ("C3", {"position": 2.0}), ("A1", {"position": "1"}),
             ("B2", {"position": -1}), ("C3", {"position": True})]
    for spec_text, wanted in ((text, [3, 0, 2, 0, 0, 0]), (SHOP, None)):
        data = tmp_path / ("with" if wanted else "without")  # a spec is read once per path
        data.mkdir()
        s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(data, spec_text)),
                           "FLYWHEEL_PATHS_DATA_DIR": str(data)})
        rows = labelled(s, shown)
        assert (list(rows["position"]) if "position" in rows else None) == wanted
    from models.train import model_spec

    assert model_spec(s).position_slots == 0  # undeclared
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(tmp_path / "with" / "shop.toml")})
    assert (model_spec(s).position_slots, model_spec(s, without=("position",)).position_slots) == (10, 0)


HIDE = '\n[[events.types]]\nname = "hide"\nrole = "negative"\n\n[tables.item]'


def test_a_negative_labels_its_exposure_0_even_when_clicked_and_is_no_positive_anywhere(tmp_path: Path) -> None:
    """A `negative` type (a hide): the exposure it follows on the same request and item is labelled 0, whatever
    label positive follows it too; no graph weight, retrieval positive or label of its own; a weight or a label on
    it is refused."""
    from feature_repo.event_log import write_batch
    from models.dataset import Window, labelled_impressions
    from streaming.consumer import Consumed
    from streaming.events import Event

    text = SHOP.replace("\n[tables.item]", HIDE, 1)
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)})
    assert (s.spec.negatives, s.spec.positives, s.spec.labels) == (("hide",), ("cart", "order"), ("order",))
    assert "hide" not in s.spec.weights and "hide" in s.spec.type_names
    t = 1_700_000_000_000
    acts = {"A1": ["order"], "B2": ["order", "hide"], "C3": ["hide"], "D4": [], "E5": ["cart", "order"]}
    events = [Event(event_id=f"{kind}-{item}", user_id="u", item_id=item, event_type=kind, request_id="r1",
                    event_time=t + 10 * n + k, context={})
              for n, (item, kinds) in enumerate(acts.items()) for k, kind in enumerate(["view", *kinds])]
    events.append(Event(event_id="hide-elsewhere", user_id="u", item_id="E5", event_type="hide", request_id="r2",
                        event_time=t + 100, context={}))  # another request's hide is not this exposure's
    write_batch(s, [Consumed(e, partition=0, offset=n) for n, e in enumerate(events)])
    rows = labelled_impressions(s, Window(*(datetime.fromtimestamp(t / 1000 + d, UTC) for d in (0, 1))))
    assert dict(zip(rows["item_id"], rows["label"])) == {"A1": 1.0, "B2": 0.0, "C3": 0.0, "D4": 0.0, "E5": 1.0}
    for extra in ("weight = 2", "label = true"):
        with pytest.raises(SpecError, match=r"#4: a negative has no weight and labels nothing"):
            parse_spec(text.replace('role = "negative"', f'role = "negative"\n{extra}'), shop(tmp_path))


def test_a_labels_declared_value_weighs_its_example_by_the_amount_over_its_windows_mean(tmp_path: Path) -> None:
    """`value = "amount"` on a label: the example an order labels weighs its amount over the mean of the window's
    amounts (an exposure's largest where several); an order without a number > 0, and every unlabelled exposure,
    weighs 1. A value on anything but a label is refused; undeclared, there is no weight column."""
    from feature_repo.event_log import write_batch
    from models.dataset import Window, labelled_impressions
    from streaming.consumer import Consumed
    from streaming.events import Event

    text = SHOP.replace("label = true", 'label = true\nvalue = "amount"', 1)
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)})
    (tmp_path / "plain").mkdir()
    assert s.spec.valued == {"order": "amount"} and s.spec.digest != parse_spec(SHOP, shop(tmp_path / "plain")).digest
    t = 1_700_000_000_000
    orders = {"A1": [{"amount": 10}], "B2": [{"amount": 50}, {"amount": 30.0}], "C3": [{"amount": "lots"}],
              "D4": [{}], "E5": []}
    events = [Event(event_id=f"{item}-{k}", user_id="u", item_id=item, event_type="order" if k else "view",
                    request_id="r1", event_time=t + 10 * n + k, context=context)
              for n, (item, given) in enumerate(orders.items()) for k, context in enumerate([{}, *given])]
    write_batch(s, [Consumed(e, partition=0, offset=n) for n, e in enumerate(events)])
    rows = labelled_impressions(s, Window(*(datetime.fromtimestamp(t / 1000 + d, UTC) for d in (0, 1))))
    assert dict(zip(rows["item_id"], rows["label_weight"])) == {"A1": 10 / 30, "B2": 50 / 30, "C3": 1.0, "D4": 1.0,
                                                                "E5": 1.0}
    assert list(rows["label"]) == [1.0, 1.0, 1.0, 1.0, 0.0]
    for where, change in (("#1", 'role = "exposure"\nvalue = "amount"'), ("#2", 'weight = 2\nvalue = "amount"'),
                          ("#3", 'label = true\nvalue = "the amount"')):
        before = change.split("\n")[0]
        with pytest.raises(SpecError, match=rf"{where}.value: expected the context field holding a label's number"):
            parse_spec(SHOP.replace(before, change, 1), shop(tmp_path))


def test_whether_items_repeat_is_declared_by_the_data(tmp_path: Path) -> None:
    """Groceries are bought again, films are not watched twice: the bundled specs say which, a bad value is
    refused, and the default is films'."""
    assert not load_settings({"FLYWHEEL_CONFIG": "/dev/null"}).spec.repeats
    from infra.settings import REPO_ROOT
    instacart = REPO_ROOT / "datasets" / "instacart" / "dataset.toml"
    assert parse_spec(instacart.read_text(), instacart).repeats
    keyed = SHOP.replace("[[events.types]]", "[events]\nrepeats = true\n\n[[events.types]]", 1)
    assert parse_spec(keyed, shop(tmp_path)).repeats
    assert parse_spec(keyed, shop(tmp_path)).digest != parse_spec(SHOP, shop(tmp_path)).digest
    with pytest.raises(SpecError, match=r"\[events\].repeats: expected bool, got str 'yes'"):
        parse_spec(keyed.replace("repeats = true", 'repeats = "yes"'), shop(tmp_path))


def test_a_spec_carries_the_settings_its_data_was_tuned_with_under_the_config_and_environment(tmp_path: Path) -> None:
    tuned = SHOP + '\n[settings.retrieval]\nsource_weights = [1.0, 1.0, 1.0, 8.0]\npopularity_prior = 0.0\n'
    environ = {"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, tuned))}
    r = load_settings(environ).retrieval
    assert (r.source_weights, r.popularity_prior, r.dim) == ((1.0, 1.0, 1.0, 8.0), 0.0, 32)  # the rest: defaults
    config = tmp_path / "flywheel.toml"
    config.write_text("[retrieval]\npopularity_prior = 2.0\n")
    r = load_settings(environ | {"FLYWHEEL_CONFIG": str(config), "FLYWHEEL_RETRIEVAL_SOURCE_WEIGHTS": "2,2,2,2"}
                      ).retrieval
    assert (r.source_weights, r.popularity_prior) == ((2.0, 2.0, 2.0, 2.0), 2.0)  # the deployment's word wins
    (tmp_path / "bad").mkdir()
    bad = shop(tmp_path / "bad", SHOP + '\n[settings.kafka]\nbootstrap_servers = "elsewhere:9092"\n')
    with pytest.raises(SettingsError, match=r"\[settings\]: a spec may tune models, .*, not kafka"):
        load_settings(environ | {"FLYWHEEL_DATASET_SPEC": str(bad)})


OBJECTIVES = '''
[objectives.click]
labels = ["cart"]

[objectives.conversion]
labels = ["order"]
over = "click"

[objectives.order]
labels = ["order"]
'''


def test_named_objectives_label_each_exposure_over_its_own_space_and_bad_ones_are_refused(tmp_path: Path) -> None:
    """`[objectives]`: the first's labels are the spec's (no type declares label = true), each further one's label
    is its types' on the same request and item, times its `over`'s (an order over the carts), none where a negative
    follows; the model spec records them. Each wrong declaration is refused with its key."""
    from feature_repo.event_log import write_batch
    from models.dataset import Window, labelled_impressions
    from models.train import model_spec
    from streaming.consumer import Consumed
    from streaming.events import Event

    text = SHOP.replace("label = true\n", "").replace("\n[tables.item]", HIDE, 1) + OBJECTIVES
    s = load_settings({"FLYWHEEL_CONFIG": "/dev/null", "FLYWHEEL_DATASET_SPEC": str(shop(tmp_path, text)),
                       "FLYWHEEL_PATHS_DATA_DIR": str(tmp_path)})
    assert s.spec.labels == ("cart",) and [(o.name, o.over) for o in s.spec.objectives] == [
        ("click", ""), ("conversion", "click"), ("order", "")]
    assert model_spec(s).objectives == (("click", ""), ("conversion", "click"), ("order", ""))
    t = 1_700_000_000_000
    acts = {"A1": ["cart", "order"], "B2": ["order"], "C3": ["cart"], "D4": [], "E5": ["cart", "order", "hide"]}
    events = [Event(event_id=f"{kind}-{item}", user_id="u", item_id=item, event_type=kind, request_id="r1",
                    event_time=t + 10 * n + k, context={})
              for n, (item, kinds) in enumerate(acts.items()) for k, kind in enumerate(["view", *kinds])]
    write_batch(s, [Consumed(e, partition=0, offset=n) for n, e in enumerate(events)])
    rows = labelled_impressions(s, Window(*(datetime.fromtimestamp(t / 1000 + d, UTC) for d in (0, 1))))
    assert {c: list(rows[c]) for c in ("label", "objective_conversion", "objective_order")} == {
        "label": [1.0, 0.0, 1.0, 0.0, 0.0], "objective_conversion": [1.0, 0.0, 0.0, 0.0, 0.0],
        "objective_order": [1.0, 1.0, 0.0, 0.0, 0.0]}
    where = "[objectives]"
    (tmp_path / "bad").mkdir()
    for change, message in (
            ((OBJECTIVES, OBJECTIVES.replace('["cart"]', '["view"]')), r"\.click\.labels: expected event types with "
             r'role = "positive" \(of cart, order\)'),
            ((OBJECTIVES, OBJECTIVES.replace('["cart"]', '["cart", "cart"]')), r"\.click\.labels: .* each once"),
            ((OBJECTIVES, OBJECTIVES.replace('over = "click"', 'over = "order"')),
             r"\.conversion\.over: expected an objective declared before it"),
            ((OBJECTIVES, OBJECTIVES.replace('labels = ["cart"]', 'labels = ["cart"]\nover = "order"')),
             r"\.click\.over: expected an objective declared before it"),
            (('role = "positive"\nweight = 5.0', 'role = "positive"\nweight = 5.0\nlabel = true'),
             r": the objectives name what is predicted: drop label = true from 'order'"),
            ((OBJECTIVES, OBJECTIVES.replace("objectives.order", "objectives.objective_x")), r": expected an objective "
             r"name"),
            ((OBJECTIVES, "\n[objectives]\n"), r": expected 1 to 4 objectives, got 0")):
        with pytest.raises(SpecError, match=re.escape(where) + message):
            parse_spec(text.replace(*change), shop(tmp_path / "bad"))
    one = text.replace(OBJECTIVES, '\n[objectives.order]\nlabels = ["order"]\nover = "order"\n')
    with pytest.raises(SpecError, match=r"\[objectives\]\.order\.over: expected an objective declared before it"):
        parse_spec(one, shop(tmp_path / "bad"))


def test_a_declared_value_is_checked_at_load_and_weighs_predictions_by_the_items_and_requests_numbers(
        tmp_path: Path) -> None:
    """`[ranking] value`: an expression of the objectives, the item's numbers and the request's, evaluated per row
    (a division by zero worth 0); every name it holds is one the spec declares, and anything but numbers, names,
    + - * / and parentheses is refused at load, with the key."""
    base = (SHOP.replace("label = true\n", "") + OBJECTIVES
            + '\n[events.context.hour]\nkind = "number"\n\n[events.context.page]\nkind = "categorical"\n'
            + '\n[events.context.basket]\nkind = "bucketed"\nbuckets = [0, 50]\n')
    spec = parse_spec(base + '\n[ranking]\nvalue = "(conversion + 0.1 * click) * price / hour"\n', shop(tmp_path))
    assert spec.value.names == ("conversion", "click", "price", "hour")
    worth = spec.value({"click": np.array([0.5, 0.2, 0.5]), "conversion": np.array([0.05, 0.1, 0.1]),
                        "price": np.array([40.0, 10.0, 40.0]), "hour": np.array([2.0, 3.0, 0.0])})
    assert np.allclose(worth, [2.0, 0.4, 0.0])
    assert parse_spec(base, shop(tmp_path)).value is None  # none declared: the first objective orders
    where = re.escape("[ranking].value: ")
    for value, message in (
            ("click * margin", r"unknown name 'margin' in 'click \* margin': expected an objective \(click, "
             r"conversion, order\), an item's number \(price\), a request's number \(hour\)"),
            ("click * page", r"unknown name 'page'"),  # a categorical field is no number
            ("click * basket", r"unknown name 'basket'"),  # nor a bucketed one's bucket
            ("click * 1e400", r"'1e400' in 'click \* 1e400' is no finite number"),
            ("price * 2", r"'price \* 2' names no objective"),
            ("click ** 2", r"'click \*\* 2' is not allowed in 'click \*\* 2': a value holds numbers, names"),
            ("max(click, order)", r"'max\(click, order\)' is not allowed"),
            ("click *", r"not an expression")):
        with pytest.raises(SpecError, match=where + message):
            parse_spec(base + f'\n[ranking]\nvalue = "{value}"\n', shop(tmp_path))
    with pytest.raises(SpecError, match=where + r"'price' is both an objective and an item's number: rename one"):
        parse_spec(base.replace("objectives.order", "objectives.price") + '\n[ranking]\nvalue = "price"\n',
                   shop(tmp_path))
    with pytest.raises(SpecError, match=where + r"a value weighs the objectives' predictions: declare \[objectives\]"):
        parse_spec(SHOP + '\n[ranking]\nvalue = "price"\n', shop(tmp_path))
    with pytest.raises(SpecError, match=re.escape("[ranking]: unknown key 'order'")):
        parse_spec(base + '\n[ranking]\nvalue = "click"\norder = "value"\n', shop(tmp_path))
