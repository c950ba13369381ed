"""The loop's outcome: what was served and learned, gathered from the registry, the prediction archive,
the event log and Kafka (`report`), and printed (`summary_lines`)."""

from __future__ import annotations

from datetime import datetime

from flywheel.demo.plan import Summary
from flywheel.datasets import dataset_flag, stop_command
from infra.settings import Settings
from infra.stack import unarchived
from models.metrics import best_baseline
from models.registry import list_versions, version_tags
from serving.outcomes import auc_by_version, auc_over_time, ctr_by_source, percentiles, served_outcomes
from streaming.topics import end_offsets


def report(s: Settings, since_ms: int, summary: Summary) -> None:
    """What was served since `since_ms` and what it led to, once the archives hold the period's end."""
    unarchived(s, wait_s=30)
    outcomes = served_outcomes(s, since_ms)
    summary.predictions_logged = outcomes["request_id"].nunique() if len(outcomes) else 0
    by_version = auc_by_version(outcomes)
    summary.served = by_version.to_dict("records")
    summary.auc_over_time = auc_over_time(outcomes, 30).to_dict("records")
    summary.recommend_sources = ctr_by_source(outcomes)
    summary.versions = list_versions(s)
    first_served = by_version.groupby("model_version")["first_served"].min().to_dict() if len(by_version) else {}
    for version, first in first_served.items():
        tags = version_tags(s, version)
        if tags.get("parent_version") and tags.get("eval_end") and "drill" not in tags:
            newest = datetime.fromisoformat(tags["eval_end"]).timestamp()
            summary.model_freshness_s[version] = first / 1000 - newest
    try:
        summary.dead_letters = sum(end_offsets(s, s.kafka.dlq_topic(s.kafka.events_topic)).values())
    except LookupError:
        summary.dead_letters = 0


def summary_lines(s: Settings, summary: Summary) -> list[str]:
    def events(counts: dict[str, int]) -> str:
        return f"{sum(counts.values()):,} ({', '.join(f'{k} {v:,}' for k, v in sorted(counts.items()))})"

    fresh = percentiles(summary.feature_freshness_s, (50, 99))
    lines = [
        "", "=== Flywheel: the loop, summary ===",
        f"events into Kafka: history {events(summary.history_events)}; live {events(summary.live_events)}; "
        f"dead-lettered {summary.dead_letters}",
        f"live requests: {summary.requests:,} ({summary.statuses}); predictions logged and joined to clicks: "
        f"{summary.predictions_logged:,} requests",
        f"feature freshness (live events sent -> the user's running total online): p50 {fresh['p50'] / 1000:.2f}s, "
        f"p99 {fresh['p99'] / 1000:.2f}s ({len(summary.feature_freshness_s)} probes; "
        f"{summary.feature_probes_timed_out} not online within 60 s)",
        "serving latency (client side, 200s): /rank " + ", ".join(f"{q} {ms:.1f} ms" for q, ms in
                                                                 summary.latency_ms.items())
        + "; /recommend " + ", ".join(f"{q} {ms:.1f} ms" for q, ms in summary.recommend_latency_ms.items()),
        f"offline_training (Airflow) -> first @champion v{summary.first_champion}: {summary.offline_training_s:.0f}s; "
        f"served {summary.first_served_s:.1f}s after the run finished",
        f"online features of user {summary.user_features.get('user_id')} after the history: "
        + ", ".join(f"{k} {v}" for k, v in summary.user_features.items()
                    if k != "user_id" and not isinstance(v, list) and v is not None),
        "ranker test AUC on the same split: " + ", ".join(f"{k} {v:.4f}" for k, v in summary.ranker_auc.items()),
        *([f"ranking ({s.spec.name}): ranker {summary.ranker_auc['ranker']:.4f}, best baseline {best[0]} "
           f"{best[1]:.4f}"] if (best := best_baseline(summary.ranker_auc)) and "ranker" in summary.ranker_auc else []),
        "model versions (newest first):"]
    served: dict[str, list[dict]] = {}  # a version's rows: one per endpoint
    for row in summary.served:
        served.setdefault(row["model_version"], []).append(row)
    for v in summary.versions:
        kind = (f"drill: {v['drill']}" if v["drill"] else f"incremental from v{v['parent']}" if v["parent"]
                else f"full ({v['kind']})")
        lines.append(f"  v{v['version']:<3} {('@' + v['aliases']) if v['aliases'] else '':<12} {kind:<22} "
                     f"gate {v['gate'] or '-'}: {v['reason'] or '-'}")
        if v["canary"]:
            lines.append(f"       canary: {v['canary']}")
        if v["rolled_back"]:
            lines.append(f"       rolled back by {v['rolled_back_by']}: {v['rolled_back']}")
        for row in served.get(v["version"], []):
            lines.append(f"       served /{row['endpoint']}: {row['requests']:,} requests / {row['items']:,} items, "
                         f"CTR {row['ctr']:.3f}, AUC on the traffic it served {row['auc']:.4f} pooled, "
                         f"{row['list_auc']:.4f} per list ({row['judged']:,} judged lists)")
        if (fresh_s := summary.model_freshness_s.get(v["version"])) is not None and v["version"] in served:
            lines.append(f"       model freshness (newest event in its data -> served) {fresh_s:.0f}s")
    if r := summary.retrieval:
        lines.append(f"retrieval: v{r['version']} of {s.retriever.name} (two-tower) recall@{s.retrieval.gate_k} "
                     f"{r['recall']:.4f}, NDCG {r['ndcg']:.4f} on {r['users']} users ("
                     + ", ".join(f"{k} {b['recall']:.4f} / {b['ndcg']:.4f}" for k, b in r.get("baselines", {}).items())
                     + f"); gate {'promoted' if r['promoted'] else 'refused'}: {r['reason']}")
    if summary.recommend_sources:
        lines.append("/recommend, served CTR per candidate source (an item two sources listed counts for both; "
                     "95% intervals over requests): " +
                     "; ".join(f"{src} {c['clicks']:,}/{c['impressions']:,} = {c['ctr']:.3f} "
                               f"({c.get('low', c['ctr']):.3f}-{c.get('high', c['ctr']):.3f})"
                               + (f", {d['ctr']:+.3f} ({d['low']:+.3f} to {d['high']:+.3f}) vs popularity"
                                  if (d := c.get("difference")) else "")
                               for src, c in summary.recommend_sources.items()))
    if r := summary.recommended:
        lines.append(f"/recommend for user {r['user_id']}: {', '.join(r['items'])}")
    if summary.refused_drill:
        d = summary.refused_drill
        lines.append(f"bad-model drill: v{d['version']} (output inverted) {d['gate']} by the gate: {d['reason']}")
    if summary.rollback:
        r = summary.rollback
        lines.append(f"rollback drill: model_rollback DAG v{r['from']} -> v{r['to']} in {r['dag_s']:.1f}s, served "
                     f"{r['served_after_dag_s']:.1f}s later")
    if r := summary.live_regression:
        honest = [v["version"] for v in summary.versions
                  if v["rolled_back_by"] == "canary-analysis" and not v["drill"]]
        lines.append(f"live-regression drill: v{r['version']} promoted by the gate at {r['promoted_at'][11:19]}, "
                     f"rolled back to v{r['control']} by the canary analysis at {r['rolled_back_at'][11:19]} "
                     f"({r['seconds']:.0f}s); honest versions the canary analysis rolled back: {len(honest)}"
                     + (f" ({', '.join(honest)})" if honest else ""))
    if c := summary.catch_up:
        lines.append((f"after the rollback: incremental_training from v{c['from']} {c['state']} (train {c['train']})"
                      + (f", v{c['version']} {c['gate']} by the gate" if c["version"] else "")
                      if "from" in c else "after the rollback: no catch-up run (the plan leaves it out)")
                     + (f"; @champion's canary: {c['canary']}" if c.get("canary") else ""))
    lines += [f"whole loop: {summary.seconds / 60:.1f} min",
              f"Airflow UI: {s.airflow.api_url} (user {s.airflow.username}; "
              f"its password: `flywheel status{dataset_flag(s)} --show-secrets`)",
              f"MLflow UI:  {s.mlflow.tracking_uri}/#/models/{s.ranker.name} (user {s.mlflow.username}; "
              f"its password: `flywheel status{dataset_flag(s)} --show-secrets`)",
              f"Ranking API: http://{s.serving.host}:{s.serving.port}/docs",
              f"Summary as JSON: {s.paths.data_dir / 'demo' / 'summary.json'}",
              "The stack keeps running; incremental_training is paused now that the demo's traffic stopped (unpause "
              f"it in the Airflow UI when yours flows); stop the stack with `{stop_command(s)}`."]
    return lines
