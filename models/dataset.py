"""Training sets: impressions from the offline event log, labelled by their clicks, joined
point-in-time correct with the `ranking_training` features.

Each impression is joined with the features as they were 1 ms before its request's first exposure,
which is what the ranking server sees when it scores the request: every candidate of a request is
scored at once, before any of them is shown, so no exposure of a request (nor its click, 1 ms or more
later) is in the features of any of its examples. Behaviors in the sequence at or after that time are
dropped for the same reason. (Joined as of each impression instead, a MovieLens session's later ratings
saw its earlier ones: test AUC 0.816 offline against 0.707 on the same version's served `/rank` lists.)

A candidate the ranking server scored and logged (the prediction archive) is trained on the numeric
features it was served with, not on the point-in-time join's (the online joiner of Monolith and JD):
the join's values differed from the served ones for 1-10 % of the demo's candidates (an item's features
cached for a second, rows not yet online when read, rows past their view's TTL that the online read
still serves; serving/consistency.py measures both).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from contract.examples import Examples
from contract.inputs import NUMERIC_FEATURES, RAW_FEATURES
from contract.transform import to_examples
from feature_repo.event_log import read_event_log
from feature_repo.files import pinned, view_dir
from feature_repo.predictions import logged_features, read_predictions
from infra.dataset import LABEL_WEIGHT, POSITION_FIELD, SCENARIO_FIELD
from infra.settings import Settings
from streaming.events import TEST_TRAFFIC
from streaming.features import LONG_HISTORY_VIEW
from streaming.history import item_keys


DAY_MS = 86_400_000


class NoImpressions(ValueError):
    """A window without impressions: nothing to train or evaluate on."""


@dataclass(frozen=True)
class Window:
    """Impressions with start <= event time < end."""

    start: datetime
    end: datetime

    def __str__(self) -> str:
        return f"[{self.start.isoformat()}, {self.end.isoformat()})"


def labelled_impressions(s: Settings, window: Window, scenario: str | None = None) -> pd.DataFrame:
    """One row per impression in `window` (event log, deduplicated by event id, test traffic left out):
    request_id, user_id, item_id, category (then each further key of the spec, then each declared context field's
    value, then, where the spec declares a position bias, the rank it was shown at), event_time (ms), request_time
    (ms: its request's first exposure, looked for up to a day before the window), label (1.0 if a click with its
    request id and item exists and no negative does; the first objective's), each further objective's label
    (`objective_<name>`: one of its types on the request and item, no negative, and its `over`'s label), and where a
    label declares a value, label_weight (the value over the mean of the window's, 1 for the rest). `scenario`: only
    the impressions whose context names it (a declared scenario's ranker learns from its own surface)."""
    start, end = (int(t.timestamp() * 1000) for t in (window.start, window.end))
    # A click comes after its impression: read a day past the window for the clicks of its last ones.
    log = read_event_log(s, start - DAY_MS, end + DAY_MS)
    log = log.filter(pc.field("event_id").is_valid())
    frame = log.select(["event_id", "user_id", "item_id", "event_type", "request_id", "event_time", "context"]
                       ).to_pandas().drop_duplicates("event_id")
    # Examples are the spec's exposures; labelled by its label types on the same request and item.
    exposures = frame[frame.event_type.isin(s.spec.exposures)]
    first = exposures.groupby("request_id")["event_time"].min().rename("request_time")
    imps = exposures[(exposures.event_time >= start) & (exposures.event_time < end)].join(first, on="request_id")
    pair = ["request_id", "item_id"]
    clicks = frame[frame.event_type.isin(s.spec.labels)]
    if s.spec.valued:  # a declared value (an order's amount): the exposure's is its labels' largest
        values = [s.spec.label_value(t, json.loads(c)) for t, c in zip(clicks["event_type"], clicks["context"])]
        clicks = clicks[pair].assign(value=np.array(values, float)).groupby(pair, as_index=False)["value"].max()
    else:
        clicks = clicks[pair].drop_duplicates()
    out = imps.merge(clicks.assign(label=1.0), on=pair, how="left")
    out["label"] = out["label"].fillna(0.0)

    def followed(types: tuple[str, ...]) -> np.ndarray:
        """Whether an event of one of `types` has each exposure's request and item."""
        hits = frame[frame.event_type.isin(types)][pair].drop_duplicates().assign(hit=True)
        return out[pair].merge(hits, on=pair, how="left")["hit"].eq(True).to_numpy()

    # A negative (a hide, a dislike) on the same request and item is the user's last word: 0 even if clicked.
    refused = followed(s.spec.negatives) if s.spec.negatives else np.zeros(len(out), bool)
    out.loc[refused, "label"] = 0.0
    for objective in s.spec.objectives[1:]:  # each further objective's label: its types, and its `over`'s label
        hit = followed(objective.labels) & ~refused
        if objective.over:
            hit &= out[s.spec.objective_column(objective.over)].to_numpy() > 0
        out[s.spec.objective_column(objective.name)] = hit.astype(float)
    if s.spec.valued:  # each valued label weighs its value against the window's mean; the rest 1
        valued = out["value"].notna() & (out["label"] > 0)
        mean = out.loc[valued, "value"].mean() if valued.any() else 1.0
        out[LABEL_WEIGHT] = np.where(valued, out["value"] / mean, 1.0)
    contexts = [json.loads(c) for c in out["context"]]
    # The keys the stream groups by (the category's first); an event without one has the catalog's, as the stream
    # job counts it.
    catalog = item_keys(s)
    of_items = [catalog.get(item) or () for item in out["item_id"]]
    for n, key in enumerate(s.spec.keys):
        out["category" if n == 0 else key] = [
            str(c[key]) if c.get(key, "") != "" else (of[n] or "" if n < len(of) else "")
            for c, of in zip(contexts, of_items)]
    for field in s.spec.context:  # the request's declared context, as the exposure carries it (its default if not)
        out[field.name] = [field.value(c.get(field.name)) for c in contexts]
    if s.spec.position_slots:  # the rank the exposure was shown at: the position bias' input
        out[POSITION_FIELD] = np.array([s.spec.position_of(c) for c in contexts], np.int32)
    kept = [c.get(TEST_TRAFFIC) is not True and (scenario is None or c.get(SCENARIO_FIELD) == scenario)
            for c in contexts]
    out = out.loc[np.array(kept, bool)]  # load tests teach nothing
    fields = dict.fromkeys((*s.spec.group_by, *(c.name for c in s.spec.context)))  # a key that is a page's: once
    columns = ["request_id", "user_id", "item_id", "category", *fields,
               *((POSITION_FIELD,) if s.spec.position_slots else ()), "event_time", "request_time", "label",
               *(s.spec.objective_column(o.name) for o in s.spec.objectives[1:]),
               *((LABEL_WEIGHT,) if s.spec.valued else ())]
    return out[columns].sort_values("event_time", kind="stable").reset_index(drop=True)


def training_frame(s: Settings, window: Window, scenario: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The labelled impressions of `window` (`labelled_impressions`) and their raw features, row by row:
    as of each one's request, and where its request was served and logged, the numeric values the
    ranking server read for it."""
    imps = labelled_impressions(s, window, scenario)
    if imps.empty:
        raise NoImpressions(f"no impressions{f' of scenario {scenario}' if scenario else ''} in {window}: nothing to "
                            "train or evaluate on")
    entity_df = imps[["user_id", "item_id", "category", *s.spec.group_by]].copy()
    entity_df["event_timestamp"] = pd.to_datetime(imps["request_time"] - 1, unit="ms", utc=True)
    entity_df["row"] = np.arange(len(imps))
    joined = features_as_of(s, entity_df)
    missing = [c for c in RAW_FEATURES if c not in joined.columns]
    if missing:
        raise ValueError(f"feature service ranking_training lacks {missing}")
    for name in (*(c.name for c in s.spec.context), *((POSITION_FIELD,) if s.spec.position_slots else ()),
                 *((LABEL_WEIGHT,) if s.spec.valued else ())):
        joined[name] = imps[name].to_numpy()  # the request's or the list's, not a stored feature
    served = served_values(s, imps)
    if len(served):
        found = imps[["request_id", "item_id"]].merge(served.assign(logged=True), on=["request_id", "item_id"],
                                                      how="left")
        logged = found["logged"].eq(True).to_numpy()
        for name in (c for c in served.columns if c in joined.columns and c not in ("request_id", "item_id")):
            column = joined[name].to_numpy(float, na_value=np.nan).copy()
            column[logged] = found[name].to_numpy(float, na_value=np.nan)[logged]
            joined[name] = column
    return imps, joined


def training_set(s: Settings, window: Window, sequence_length: int,
                 scenario: str | None = None) -> tuple[Examples, np.ndarray]:
    """The examples of `window` (of `scenario` alone, when named) in time order (of their impressions), each with its
    features as of its request (`training_frame`), and their event times (ms)."""
    imps, joined = training_frame(s, window, scenario)
    labels = imps[[s.spec.objective_column(o.name) for o in s.spec.objectives] or ["label"]].to_numpy()
    return to_examples(joined, imps["request_time"].to_numpy(), labels, sequence_length), \
        imps["event_time"].to_numpy()


def served_values(s: Settings, imps: pd.DataFrame) -> pd.DataFrame:
    """Per (request_id, item_id) of the impressions' requests that the ranking server logged (served, not
    shadow), the numeric features it read for the item (NaN: nothing stored; serving/features.py logs them)."""
    start, end = int(imps["request_time"].min()) - DAY_MS, int(imps["event_time"].max()) + 1
    table = read_predictions(s, start, end, columns=["request_id", "items", "features", "shadow", "served_at"])
    wanted = pa.array(imps["request_id"].unique(), pa.string())
    table = table.filter(~pc.field("shadow") & pc.field("request_id").isin(wanted))
    frame = logged_features(table, NUMERIC_FEATURES)
    return frame.drop_duplicates(["request_id", "item_id"])


def features_as_of(s: Settings, entity_df: pd.DataFrame) -> pd.DataFrame:
    """Every raw feature of each entity row (`row`, `event_timestamp`, `user_id`, `item_id`, `category`),
    point-in-time: the views' (`as_of`) and the long history's (`long_history_as_of`), in row order."""
    joined = as_of(s, entity_df).merge(long_history_as_of(s, entity_df), on="row")
    return joined.sort_values("row", kind="stable").reset_index(drop=True)


def as_of(s: Settings, entity_df: pd.DataFrame) -> pd.DataFrame:
    """Each entity row's (`row`, `event_timestamp` and the keys) features of the feature service
    `ranking_training` but the long history, point-in-time: per view, the newest row of its key at or
    before the time and within the view's TTL (Feast's semantics), by an ASOF join in DuckDB per view.
    Not Feast's `get_historical_features`: its DuckDB store joins every earlier row of a key before keeping
    the newest, which grows with each key's rows (an Instacart customer's 6,000 exposures ran 15 GB out)."""
    import duckdb

    from feature_repo.definitions import BATCH_VIEWS, TIMESTAMP_FIELD  # Feast's SDK: not for the serving path
    from streaming.features import STREAM_VIEWS

    out = entity_df.copy()
    with duckdb.connect() as con:
        con.register("entities", entity_df)
        for view in (*(v for v in STREAM_VIEWS if v is not LONG_HISTORY_VIEW), *BATCH_VIEWS):
            names = [name for name, _ in view.columns]
            with pinned(lambda: sorted(view_dir(s, view.name).glob("*.parquet"))) as files:
                if not files:
                    out = out.assign(**{name: None for name in names})
                    continue
                ttl = getattr(view, "ttl", None)
                live = (f"h.{TIMESTAMP_FIELD} >= e.event_timestamp - INTERVAL {int(ttl.total_seconds())} SECOND"
                        if ttl else "TRUE")
                on = " AND ".join(f'e."{k}" = h."{k}"' for k in view.keys)
                frame = con.sql(f"""
                    SELECT e.row, {", ".join(f'CASE WHEN {live} THEN h."{n}" END AS "{n}"' for n in names)}
                    FROM entities e ASOF LEFT JOIN ({newest_per_time(files, view.keys, TIMESTAMP_FIELD)}) h
                      ON {on} AND e.event_timestamp >= h.{TIMESTAMP_FIELD}
                    ORDER BY e.row""").df()
            # Missing integers as NaN, as Feast gives them (DuckDB's nullable Int64 has pd.NA)
            out = out.merge(frame.astype({c: "float64" for c, t in frame.dtypes.items()
                                          if isinstance(t, pd.api.extensions.ExtensionDtype) and t.kind in "iu"}),
                            on="row")
    return out


def newest_per_time(files: list[str], keys: tuple[str, ...], timestamp: str) -> str:
    """SQL for a view's offline rows, the last written of a key's rows with the same event time (an
    aggregate updated by several events of one millisecond: its newest count). A key's rows come from one
    Kafka partition, and file names and rows follow its offsets: `files` (pinned) in the names' order."""
    return f"""SELECT * FROM read_parquet({files!r}, union_by_name = true, filename = true, file_row_number = true)
               QUALIFY row_number() OVER (PARTITION BY {", ".join(f'"{k}"' for k in keys)}, {timestamp}
                                          ORDER BY list_position({files!r}, filename) DESC, file_row_number DESC) = 1"""


def long_history_as_of(s: Settings, entity_df: pd.DataFrame) -> pd.DataFrame:
    """Each entity row's (`row`, `user_id`, `category`, `event_timestamp`) long history, point-in-time:
    the user's newest `user_history` row at or before the time and within the view's TTL, by an ASOF join
    in DuckDB, with only the row's category kept (all a training example reads of it, as the server
    gives each candidate its category's). Not Feast's join: its DuckDB store joins every earlier row of a
    key before keeping the newest, and with the long history's lists that took 18 GB on MovieLens."""
    import duckdb

    from feature_repo.definitions import TIMESTAMP_FIELD  # Feast's SDK: not for the serving path

    ttl_s = int(LONG_HISTORY_VIEW.ttl.total_seconds())
    with pinned(lambda: sorted(view_dir(s, LONG_HISTORY_VIEW.name).glob("*.parquet"))) as files, \
            duckdb.connect() as con:
        if not files:
            return pd.DataFrame({"row": entity_df["row"]}).assign(**{name: None for name, _ in LONG_HISTORY_VIEW.columns})
        con.register("entities", entity_df[["row", "user_id", "category", "event_timestamp"]])
        return con.sql(f"""
            WITH joined AS (
              SELECT e.row, e.category, h.history_length, h.history_categories AS cats,
                     h.history_category_counts AS counts, h.history_item_ids AS items, h.history_event_types AS kinds,
                     COALESCE(list_position(h.history_categories, e.category), 0) AS pos,
                     len(h.history_item_ids) // greatest(len(h.history_categories), 1) AS k,
                     h.{TIMESTAMP_FIELD} >= e.event_timestamp - INTERVAL {ttl_s} SECOND AS live
              FROM entities e ASOF LEFT JOIN ({newest_per_time(files, ("user_id",), TIMESTAMP_FIELD)}) h
                ON e.user_id = h.user_id AND e.event_timestamp >= h.{TIMESTAMP_FIELD})
            SELECT row, CASE WHEN live THEN history_length END AS history_length,
                   CASE WHEN live THEN (CASE WHEN pos > 0 THEN [category] ELSE [] END) END AS history_categories,
                   CASE WHEN live THEN (CASE WHEN pos > 0 THEN [counts[pos]] ELSE [] END) END AS history_category_counts,
                   CASE WHEN live THEN (CASE WHEN pos > 0 THEN list_slice(items, (pos - 1) * k + 1, pos * k)
                                        ELSE [] END) END AS history_item_ids,
                   CASE WHEN live THEN (CASE WHEN pos > 0 THEN list_slice(kinds, (pos - 1) * k + 1, pos * k)
                                        ELSE [] END) END AS history_event_types
            FROM joined ORDER BY row""").df()


def chronological_split(ex: Examples, times_ms: np.ndarray, validation: float = 0.1, test: float = 0.1
                        ) -> tuple[Examples, Examples, Examples, dict[str, str]]:
    """Train on the past, validate and test on the most recent windows. Returns the three parts and
    their time ranges."""
    n = len(ex)
    a, b = int(n * (1 - validation - test)), int(n * (1 - test))
    if min(a, b - a, n - b) == 0:
        raise ValueError(f"{n} examples are too few to split {1 - validation - test:.0%}/{validation:.0%}/{test:.0%}")

    def span(i: int, j: int) -> str:
        return " .. ".join(datetime.fromtimestamp(times_ms[k] / 1000, UTC).isoformat() for k in (i, j - 1))

    return (ex.take(slice(0, a)), ex.take(slice(a, b)), ex.take(slice(b, n)),
            {"train": span(0, a), "validation": span(a, b), "test": span(b, n)})
