"""What served predictions led to: the prediction archive joined with the clicks of the event log that
followed (by request id and item), and the AUC of each model version on the traffic it served, per
endpoint, pooled over items and per list.

Reads the offline archives, not the topics, so it answers for any past period, across broker restarts.
Shadow predictions are left out: they were never shown.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from feature_repo.event_log import read_event_log
from infra.settings import Settings
from models.metrics import auc
from feature_repo.predictions import read_predictions

POPULARITY = "popularity"  # the source the others are compared with: what anyone could serve
COLUMNS = ["request_id", "item_id", "model_version", "route", "served_at", "score", "label", "sources", "user_id"]


def served_outcomes(s: Settings, since_ms: int | None = None, until_ms: int | None = None,
                    model: str | None = None) -> pd.DataFrame:
    """One row per scored item `model` (the platform's ranker by default; a scenario's has versions of its own)
    served in since_ms <= served_at < until_ms (all archived when not given): request_id, item_id, model_version,
    route, served_at (ms), score, label (1.0 if the user clicked it on that request), sources (the candidate sources
    of a recommended item; None: a ranked one), user_id."""
    clicks = _clicks(s, since_ms)
    return _rows(_shown(s, since_ms, until_ms, model), clicks)


def clicked_outcomes(s: Settings, since_ms: int, pooled: bool = True,
                     model: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What served_outcomes gives since `since_ms`, for the lists with a click only (the rest are all
    passes: nothing to rank by), and every list's `totals` (their pooled AUC when `pooled`). Its Python work
    grows with the clicked lists, not with the traffic (a load test's millions of rows)."""
    clicks = _clicks(s, since_ms)
    shown = _shown(s, since_ms, None, model)
    clicked = pc.is_in(shown["request_id"], value_set=pa.array(sorted({r for r, _ in clicks}), pa.string()))
    outcomes = _rows(shown.filter(clicked), clicks)
    return outcomes, totals(shown, clicked.to_numpy(zero_copy_only=False), outcomes, pooled)


TOTALS = ["model_version", "route", "endpoint", "requests", "items", "auc"]


def totals(shown: pa.Table, clicked: np.ndarray, outcomes: pd.DataFrame, pooled: bool = True) -> pd.DataFrame:
    """Per model_version, route and endpoint of the `shown` lists (`clicked`: those with a click, whose rows
    `outcomes` holds): requests, items shown, and when `pooled` the version's `auc` on the endpoint (every
    route) pooled over every scored item (an unclicked list's all passes): what auc_by_version has from
    every list's rows, without a row per item (a load test's 5 minutes, 4M items: ~2 s of a core)."""
    keys = ["model_version", "route", "endpoint"]
    lists = pd.DataFrame({k: shown[k].to_numpy(zero_copy_only=False) for k in keys[:2]}).assign(
        endpoint=np.where(pc.is_null(shown["sources"]).to_numpy(zero_copy_only=False), RANK, RECOMMEND),
        request_id=shown["request_id"].to_numpy(zero_copy_only=False),
        items=pc.fill_null(pc.list_value_length(shown["items"]), 0).to_numpy())
    if lists.empty:
        return pd.DataFrame(columns=TOTALS)
    out = lists.groupby(keys).agg(requests=("request_id", "nunique"), items=("items", "sum")).reset_index()
    if not pooled:
        return out.assign(auc=np.nan)[TOTALS]
    # The unclicked lists' scores, flat, each with its list's (version, endpoint) as one code.
    scoring = ["model_version", "endpoint"]
    codes, pairs = pd.MultiIndex.from_frame(lists[scoring]).factorize()
    unclicked = shown.filter(pa.array(~clicked))
    passes = pc.list_flatten(unclicked["scores"]).to_numpy(zero_copy_only=False).astype(float)
    pass_codes = np.repeat(codes[~clicked], pc.fill_null(pc.list_value_length(unclicked["scores"]), 0).to_numpy())
    rows = outcomes.assign(endpoint=endpoints(outcomes))
    aucs = {}
    for code, pair in enumerate(pairs):
        mine = rows[(rows["model_version"] == pair[0]) & (rows["endpoint"] == pair[1])]
        scores = np.concatenate([mine["score"].to_numpy(float), passes[pass_codes == code]])
        labels = np.concatenate([mine["label"].to_numpy(float), np.zeros(len(scores) - len(mine))])
        scored = ~np.isnan(scores)
        aucs[pair] = _auc(pd.DataFrame({"label": labels[scored], "score": scores[scored]}))
    return out.assign(auc=[aucs[(v, e)] for v, e in zip(out["model_version"], out["endpoint"])])[TOTALS]


def _clicks(s: Settings, since_ms: int | None) -> set[tuple[str, str]]:
    """(request id, item) of every click since `since_ms`. Clicks follow what they click: none before the
    period, nor in a file written before it."""
    log = read_event_log(s, since_ms, columns=["request_id", "item_id", "event_type"], written_since_ms=since_ms)
    log = log.filter(pc.field("event_type").isin(list(s.spec.labels)))
    return set(zip(log.column("request_id").to_pylist(), log.column("item_id").to_pylist()))


_SHOWN = ["request_id", "items", "scores", "model_version", "route", "served_at", "sources", "user_id"]


def _shown(s: Settings, since_ms: int | None, until_ms: int | None, model: str | None) -> pa.Table:
    """The archived lists `model` (the platform's ranker by default) served users (shadow predictions never
    were shown)."""
    table = read_predictions(s, since_ms, until_ms, columns=[*_SHOWN, "shadow", "model_name"])
    return table.filter(~pc.field("shadow") & (pc.field("model_name") == (model or s.ranker.name)))


def _rows(shown: pa.Table, clicks: set[tuple[str, str]]) -> pd.DataFrame:
    rows = []
    for p in shown.select(_SHOWN).to_pylist():
        for item, score, sources in zip(p["items"], p["scores"], p["sources"] or [None] * len(p["items"])):
            if score is not None:
                rows.append((p["request_id"], item, p["model_version"], p["route"], p["served_at"], score,
                             float((p["request_id"], item) in clicks), sources, p["user_id"]))
    return pd.DataFrame(rows, columns=COLUMNS)


RANK, RECOMMEND = "rank", "recommend"  # the endpoint that served a list: only /recommend's items name sources


def endpoints(outcomes: pd.DataFrame) -> pd.Series:
    """Each row's endpoint: a recommended item names the candidate sources that listed it, a ranked one none."""
    return pd.Series(np.where(outcomes["sources"].isna(), RANK, RECOMMEND), index=outcomes.index, dtype=object)


def _auc(frame: pd.DataFrame) -> float:
    labels = frame["label"].to_numpy()
    return auc(labels, frame["score"].to_numpy()) if 0 < labels.sum() < len(labels) else float("nan")


def list_aucs(outcomes: pd.DataFrame) -> pd.DataFrame:
    """One row per judged list (a click and a pass among its items): model_version, route, endpoint,
    request_id, auc (the share of (click, pass) pairs ordered right, ties counting half)."""
    clicked = outcomes[outcomes["request_id"].isin(outcomes.loc[outcomes["label"] > 0.5, "request_id"])] \
        if len(outcomes) else outcomes  # a list without a click judges nothing: skipped unread
    rows = []
    for (version, route, endpoint, request), g in clicked.groupby(
            ["model_version", "route", endpoints(clicked), "request_id"], sort=False):
        labels, scores = g["label"].to_numpy(), g["score"].to_numpy()
        hits, passes = scores[labels > 0.5], scores[labels <= 0.5]
        if len(hits) and len(passes):
            wins = (hits[:, None] > passes[None, :]).mean() + 0.5 * (hits[:, None] == passes[None, :]).mean()
            rows.append((version, route, endpoint, request, float(wins)))
    return pd.DataFrame(rows, columns=["model_version", "route", "endpoint", "request_id", "auc"])


def auc_by_version(outcomes: pd.DataFrame) -> pd.DataFrame:
    """Per model version and endpoint (/rank lists apart from /recommend ones: a recommended list holds
    items the user never saw elsewhere, few clicked): requests, items shown, clicks, CTR, `auc` pooled
    over its items (as the offline test AUC is), `list_auc` the mean over its `judged` lists (as the
    canary judges), first/last served (ms). A version's rows together, in order of its first serving."""
    if not len(outcomes):
        return pd.DataFrame()
    lists = list_aucs(outcomes)
    rows = []
    for (version, endpoint), g in outcomes.assign(endpoint=endpoints(outcomes)).groupby(
            ["model_version", "endpoint"], sort=False):
        judged = lists.loc[(lists["model_version"] == version) & (lists["endpoint"] == endpoint), "auc"]
        rows.append({"model_version": version, "endpoint": endpoint, "requests": g["request_id"].nunique(),
                     "items": len(g), "clicks": int(g["label"].sum()), "ctr": float(g["label"].mean()),
                     "auc": _auc(g), "list_auc": float(judged.mean()) if len(judged) else float("nan"),
                     "judged": len(judged), "first_served": int(g["served_at"].min()),
                     "last_served": int(g["served_at"].max())})
    table = pd.DataFrame(rows)
    first = table.groupby("model_version")["first_served"].transform("min")
    return table.assign(_first=first).sort_values(["_first", "endpoint"]).drop(columns="_first").reset_index(drop=True)


def ctr_by_source(outcomes: pd.DataFrame, resamples: int = 1000) -> dict[str, dict[str, float]]:
    """Recommended items shown and clicked per candidate source ({source: {impressions, clicks, ctr, low,
    high}}); an item two sources listed counts for both. low-high: the CTR's 95% interval, a bootstrap over
    the requests (a list's items are not independent draws), and "difference" the source's CTR minus
    popularity's ({ctr, low, high}) on the same resampled requests, so a claim that one source beats another
    comes with its noise."""
    recommended = outcomes[outcomes["sources"].notna()] if len(outcomes) else outcomes
    shown = recommended.explode("sources") if len(recommended) else recommended
    if not len(shown):
        return {}
    counts = shown.groupby(["request_id", "sources"])["label"].agg(["size", "sum"]).unstack(fill_value=0)
    impressions, clicks = counts["size"].to_numpy(float), counts["sum"].to_numpy(float)  # [requests, sources]
    draws = np.random.default_rng(0).integers(0, len(counts), (resamples, len(counts)))
    with np.errstate(invalid="ignore", divide="ignore"):
        ctr = clicks[draws].sum(1) / impressions[draws].sum(1)  # [resamples, sources]
    sources = list(counts["size"].columns)
    out = {}
    for k, source in enumerate(sources):
        low, high = np.nanpercentile(ctr[:, k], [2.5, 97.5])
        out[source] = {"impressions": int(impressions[:, k].sum()), "clicks": int(clicks[:, k].sum()),
                       "ctr": float(clicks[:, k].sum() / impressions[:, k].sum()), "low": float(low),
                       "high": float(high)}
    if POPULARITY in sources:
        base = sources.index(POPULARITY)
        for k, source in enumerate(sources):
            if k != base:
                low, high = np.nanpercentile(ctr[:, k] - ctr[:, base], [2.5, 97.5])
                out[source]["difference"] = {"ctr": out[source]["ctr"] - out[POPULARITY]["ctr"], "low": float(low),
                                             "high": float(high)}
    return out


def auc_over_time(outcomes: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    """AUC per model version and endpoint per `bucket_s` of serving time: model_version, endpoint, t (ms,
    bucket start), items, auc (pooled)."""
    if outcomes.empty:
        return pd.DataFrame(columns=["model_version", "endpoint", "t", "items", "auc"])
    bucket = (outcomes["served_at"] // int(bucket_s * 1000)) * int(bucket_s * 1000)
    rows = [{"model_version": v, "endpoint": e, "t": int(t), "items": len(g), "auc": _auc(g)}
            for (v, e, t), g in outcomes.groupby(["model_version", endpoints(outcomes), bucket])]
    return pd.DataFrame(rows).sort_values(["t", "model_version", "endpoint"]).reset_index(drop=True)


def percentiles(seconds: list[float], qs: tuple[float, ...] = (50, 95, 99)) -> dict[str, float]:
    """Latency percentiles in milliseconds ({"p50": ...}); NaN when there is nothing to measure."""
    values = np.asarray(seconds) * 1000
    return {f"p{q:g}": float(np.percentile(values, q)) if len(values) else float("nan") for q in qs}
