"""The platform's main job: the whole loop on the running stack (`flywheel demo`).

The data are the dataset spec's (`flywheel demo --dataset instacart`; MovieLens-100k by default), cut in
two at the split (the spec's `[demo]`, `LoopPlan.of`).
1. History: the spec's past events before the split go into Kafka; the Flink job turns them into online
   features (waited for); the catalog (batch features) is loaded.
2. `offline_training` through Airflow on the history, with the baselines of the same split (popularity,
   logistic regression): the first @champion, which the ranking server (a stack service following the
   registry) loads by itself. Then the behavior graph and the retrieval model (against popularity and
   co-occurrence), the candidates of /recommend.
3. Live: the rest of the history as traffic through the ranking API (`sessions`: a MovieLens user's
   ratings close together in time, or one request of a history file such as an Instacart order), at
   `rate` requests/s. The scored items are shown in rank order: exposures, and the user's actions on
   those they act on, go to Kafka now, with the request id (the prediction log joins them).
   `incremental_training` runs on its Airflow cadence from this served traffic, promotes versions that
   pass the gate, and the server follows.
4. Drills, once an incremental version serves: a deliberately bad version (the champion with its
   output inverted) is refused by the gate; the `model_rollback` DAG moves @champion back and the
   server follows; a live regression (the inverted version again, gated on labels swapped upstream, so the
   gate promotes it) serves half the users in its canary until the canary analysis rolls it back by itself
   (serving/canary.py), within a minute.
5. The summary: events, feature freshness, versions and gate decisions, each version's AUC on the
   traffic it served, model freshness, serving latency. Also written to `<data_dir>/demo/`.

Modules by job: `loop` runs the stages; `sessions` cuts the live part of the history into requests;
`traffic` generates the live load; `probes` watch features
and the server; `drills` are the bad-model, rollback and live-regression drills; `summary` collects and prints.
"""

from flywheel.demo.loop import run_loop
from flywheel.demo.plan import LoopError, LoopPlan, Summary
from flywheel.demo.summary import summary_lines

__all__ = ["LoopError", "LoopPlan", "Summary", "run_loop", "summary_lines"]
