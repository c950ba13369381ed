"""AUC per served model version, overall and over time; and the join reading the offline archives, so it
outlives the (in-memory) broker that carried the predictions and the clicks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from confluent_kafka import Producer
from kafka import KafkaAdminClient

from infra import stack
from infra.progress import read_progress, wait_caught_up
from infra.settings import Settings, load_settings
from serving.outcomes import (auc_by_version, auc_over_time, ctr_by_source, list_aucs, percentiles, served_outcomes,
                              totals)
from feature_repo.predictions import read_predictions
from serving.prediction_log import PredictionLog
from streaming.consumer import read_dead_letter
from streaming.events import Event
from streaming.producer import EventProducer
from streaming.topics import end_offsets, ensure_topics, read_range
from tests.conftest import REPO, run_cli, stack_environ, wait_for


def _outcomes() -> pd.DataFrame:
    rows = []
    for n in range(40):  # v1 ranks every click first; v2 ranks every click last; v2 starts after 60 s
        label = float(n % 2)
        sources = (["graph", "popularity"] if n % 4 == 1 else ["graph"]) if n < 8 else None  # recommended
        rows.append((f"r{n}", f"i{n}", "1", "champion", 1_000 + n * 1_000, 0.1 + 0.8 * label, label, sources))
        rows.append((f"s{n}", f"i{n}", "2", "champion", 61_000 + n * 1_000, 0.9 - 0.8 * label, label, None))
    return pd.DataFrame(rows, columns=["request_id", "item_id", "model_version", "route", "served_at", "score",
                                       "label", "sources"])


def test_each_version_is_judged_on_the_traffic_it_served() -> None:
    table = auc_by_version(_outcomes()).set_index(["model_version", "endpoint"])
    assert table.loc[("1", "rank"), "auc"] == 1.0 and table.loc[("2", "rank"), "auc"] == 0.0
    assert table.loc[("1", "rank"), "requests"] == 32 and table.loc[("1", "recommend"), "requests"] == 8
    assert table.loc[("1", "rank"), "clicks"] == 16 and table.loc[("1", "rank"), "ctr"] == 0.5
    assert table.loc[("1", "recommend"), "first_served"] == 1_000 and table.loc[("2", "rank"), "last_served"] == 100_000
    assert list(auc_by_version(_outcomes()).model_version) == ["1", "1", "2"]  # in order of first serving


def test_served_quality_is_measured_per_endpoint_pooled_and_per_list() -> None:
    """/rank lists apart from /recommend ones, each pooled over its items and as the mean of its lists' AUC:
    a model that orders every list right but scores one list's items all above another's (a user's level,
    not an item's) is perfect per list and not pooled; recommended lists do not blur a ranker's figure."""
    rows = []
    for n in range(20):  # /rank: in list n the click scores 0.5 + n/50, the pass 0.49 + n/50 (each list right)
        for item, label, score in (("a", 1.0, 0.5 + n / 50), ("b", 0.0, 0.49 + n / 50)):
            rows.append((f"r{n}", f"{item}{n}", "1", "champion", 1_000 + n, score, label, None))
    for n in range(10):  # /recommend: the click scored lowest in each list
        for item, label, score in (("c", 1.0, 0.1), ("d", 0.0, 0.9), ("e", 0.0, 0.8)):
            rows.append((f"q{n}", f"{item}{n}", "1", "champion", 2_000 + n, score, label, ["graph"]))
    rows.append(("z", "z0", "1", "champion", 3_000, 0.3, 0.0, None))  # no click: no list AUC, still shown
    frame = pd.DataFrame(rows, columns=["request_id", "item_id", "model_version", "route", "served_at", "score",
                                        "label", "sources"])
    table = auc_by_version(frame).set_index("endpoint")
    ranked, recommended = table.loc["rank"], table.loc["recommend"]
    assert ranked["list_auc"] == 1.0 and ranked["judged"] == 20 and ranked["requests"] == 21
    assert 0.5 < ranked["auc"] < 0.6  # a higher list's pass outscores a lower list's click
    assert recommended["list_auc"] == 0.0 and recommended["auc"] == 0.0 and recommended["judged"] == 10
    assert set(list_aucs(frame).endpoint) == {"rank", "recommend"}
    pooled = auc_by_version(frame.assign(sources=None)).set_index("endpoint").loc["rank"]
    assert pooled["auc"] < ranked["auc"]  # both pooled: the recommended lists drag the figure down


def test_every_lists_totals_pool_the_unclicked_lists_as_passes_without_their_rows() -> None:
    """The analyst's totals (requests, items, pooled AUC per version and endpoint) from the clicked lists'
    rows and the unclicked lists as archived: what auc_by_version gives from every row."""
    rng = np.random.default_rng(4)
    lists, rows = [], []
    for n in range(300):
        version, sources = str(1 + n % 2), (None if n % 3 else [["graph"], ["popularity"], ["graph"]])
        scores = rng.random(3).tolist()
        labels = [float(rng.random() < (0.1 + 0.3 * sc if version == "1" else 0.2)) for sc in scores]
        scores[2] = None if n % 7 == 0 else scores[2]  # an item shown unscored: counted shown, not judged
        lists.append({"request_id": f"r{n}", "items": ["a", "b", "c"], "scores": scores, "model_version": version,
                      "route": "champion", "served_at": n, "sources": sources, "clicked": any(labels)})
        rows += [(f"r{n}", item, version, "champion", n, sc, label, sources[k] if sources else None)
                 for k, (item, sc, label) in enumerate(zip("abc", scores, labels)) if sc is not None]
    everything = pd.DataFrame(rows, columns=["request_id", "item_id", "model_version", "route", "served_at",
                                             "score", "label", "sources"])
    shown = pa.Table.from_pylist(lists)
    clicked = shown["clicked"].to_numpy()
    got = totals(shown, clicked, everything[everything["request_id"].isin(shown.filter(clicked)["request_id"]
                                                                          .to_pylist())])
    want = auc_by_version(everything).set_index(["model_version", "endpoint"])
    got = got.set_index(["model_version", "endpoint"]).loc[want.index]
    assert got["requests"].tolist() == want["requests"].tolist() == [100, 50, 100, 50]
    assert (got["items"] == 3 * got["requests"]).all() and (want["items"] < got["items"]).all()  # unscored too
    assert np.allclose(got["auc"], want["auc"]) and got.loc[("1", "rank"), "auc"] > 0.6


def test_auc_over_time_buckets_by_serving_time_and_version() -> None:
    points = auc_over_time(_outcomes(), bucket_s=30)
    assert set(points[points.t < 60_000].model_version) == {"1"}
    assert set(points[points.t >= 90_000].model_version) == {"2"}
    assert points["items"].sum() == 80
    one_label = auc_over_time(_outcomes().iloc[:2:2], bucket_s=30)  # a bucket with no click has no AUC
    assert math.isnan(one_label.auc.iloc[0])


def test_recommended_items_count_for_each_source_that_listed_them() -> None:
    # r0..r7 recommended; the odd ones (clicked) r1 and r5 also listed by popularity.
    by_source = ctr_by_source(_outcomes())
    counts = {src: {k: c[k] for k in ("impressions", "clicks", "ctr")} for src, c in by_source.items()}
    assert counts == {"graph": {"impressions": 8, "clicks": 4, "ctr": 0.5},
                      "popularity": {"impressions": 2, "clicks": 2, "ctr": 1.0}}
    graph, popularity = by_source["graph"], by_source["popularity"]
    assert 0 < graph["low"] < 0.5 < graph["high"] < 1  # 8 requests: a wide interval around 0.5
    assert popularity["low"] == popularity["high"] == 1.0  # every resample of its requests is clicked
    assert graph["difference"]["ctr"] == -0.5 and graph["difference"]["low"] < -0.5 < graph["difference"]["high"]
    assert ctr_by_source(_outcomes().iloc[:0]) == {}


def test_the_ctr_interval_narrows_with_the_requests() -> None:
    rows = [(f"r{n}", f"i{n}-{k}", "1", "champion", n, 0.5, float(k == 0 and n % 5 == 0), ["two-tower"])
            for n in range(2000) for k in range(4)]
    c = ctr_by_source(pd.DataFrame(rows, columns=_outcomes().columns))["two-tower"]
    assert c["ctr"] == 0.05 and c["low"] < 0.05 < c["high"] and c["high"] - c["low"] < 0.02


def test_no_traffic_is_no_figures() -> None:
    assert auc_by_version(_outcomes().iloc[:0]).empty
    assert auc_over_time(_outcomes().iloc[:0], 30).empty
    assert math.isnan(percentiles([])["p99"])
    assert percentiles([0.010, 0.020, 0.030], (50,)) == {"p50": 20.0}


@pytest.mark.stack
def test_the_served_auc_per_version_outlives_a_broker_restart(tmp_path: Path) -> None:
    """Predictions (v1 ranks each clicked item first, v2 last, a shadow record never shown) and the clicks
    that followed, archived by the real consumers; once the topic no longer holds them (past its retention,
    here deleted and created again) and the broker restarted, the archive still answers: AUC per version,
    the features each record was scored on, and `flywheel outcomes`."""
    environ = stack_environ(tmp_path / "data", FLYWHEEL_STACK_SERVICES="kafka")
    s = load_settings(environ)
    stack.up(s)
    ensure_topics(s, [s.kafka.events_topic, s.serving.predictions_topic])
    archives = [subprocess.Popen([sys.executable, "-m", module], env=environ, cwd=REPO,
                                 stderr=(tmp_path / f"{module}.log").open("w"))
                for module in ("feature_repo.event_log", "serving.prediction_archive")]
    try:
        now = int(time.time() * 1000)
        log, sent = PredictionLog(s), []
        for n in range(40):
            version, shadow = ("1", False) if n < 20 else ("2", n == 39)
            good = 0.9 if version == "1" else 0.1  # the clicked item's score
            record = {"request_id": f"r{n}", "user_id": f"u{n % 5}", "items": ["clicked", "ignored"],
                      "categories": ["Drama", None], "scores": [good, 1 - good], "model_name": s.models.name,
                      "model_version": version, "route": "champion", "shadow": shadow, "tier": "normal",
                      "served_at": now + n, "features": {"user_clicks_5m": [n, None], "sequence": ["7", "9"]}}
            log.write(record["user_id"], record)
            sent.append(record)
        log.close()
        raw = Producer(s.kafka.client_options("librdkafka", "serving"))
        raw.produce(s.serving.predictions_topic, b"{not json")
        raw.produce(s.serving.predictions_topic, json.dumps(sent[0] | {"served_at": "yesterday"}).encode())
        not_an_object = {"features": [1]} | {k: v for k, v in sent[1].items() if k != "features"}
        raw.produce(s.serving.predictions_topic, json.dumps(not_an_object).encode())
        assert raw.flush(10) == 0
        with EventProducer(s) as producer:
            for n in range(40):
                producer.send(Event(event_id=f"c{n}", user_id=f"u{n % 5}", item_id="clicked",
                                    event_type="click", request_id=f"r{n}", event_time=now + n + 500))
        for archive in ("event-log", "prediction-archive"):
            # Started, first: on a loaded machine its imports outlast the producing (no report yet: None).
            wait_for(lambda: _started(s, archive), timeout_s=180)
            assert wait_caught_up(s, archive, wait_s=60) == 0, archive
        before = auc_by_version(served_outcomes(s)).set_index("model_version")
        dlq = s.kafka.dlq_topic(s.serving.predictions_topic)
        letters = [read_dead_letter(r) for r in read_range(s, dlq, {}, end_offsets(s, dlq))]
        assert [d.reason.split(":")[0] for d in letters] == ["malformed prediction record"] * 3
        reasons = {d.value[:9]: d.reason for d in letters}  # partitions: in either order
        assert set(reasons) == {b"{not json", b'{"request', b'{"feature'} and "served_at" in reasons[b'{"request']
        assert "features" in reasons[b'{"feature']
    finally:
        for p in archives:
            p.terminate()
            p.wait(20)
        stack.down(s)
    assert before.loc["1", "auc"] == 1.0 and before.loc["2", "auc"] == 0.0
    assert before.loc["1", "requests"] == 20 and before.loc["2", "requests"] == 19  # the shadow one was not shown
    archived = read_predictions(s).to_pylist()
    assert len(archived) == 40  # exactly the records served (the malformed one went to the dead letters)
    r7 = next(r for r in archived if r["request_id"] == "r7")
    assert json.loads(r7["features"]) == sent[7]["features"] and r7["scores"] == sent[7]["scores"]

    stack.up(s)  # the broker keeps its log: the records are dropped from it as retention would
    try:
        admin = KafkaAdminClient(**s.kafka.client_options("kafka-python", "admin"))
        admin.delete_topics([s.serving.predictions_topic])
        wait_for(lambda: _assert_gone(admin, s.serving.predictions_topic), timeout_s=30)
        admin.close()
        ensure_topics(s, [s.serving.predictions_topic])
        assert sum(end_offsets(s, s.serving.predictions_topic).values()) == 0
        shown = run_cli(environ, "outcomes", "--json")
        assert shown.returncode == 0, shown.stderr
        after = {row["model_version"]: row for row in json.loads(shown.stdout)}
        assert {v: (r["requests"], r["auc"]) for v, r in after.items()} == {"1": (20, 1.0), "2": (19, 0.0)}
    finally:
        stack.down(s)


def _assert_gone(admin: KafkaAdminClient, topic: str) -> None:
    assert topic not in admin.list_topics()


def _started(s: Settings, service: str) -> None:
    assert read_progress(s, service) is not None, f"{service} has not reported yet"
