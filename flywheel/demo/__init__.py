"""The platform's main job: the whole loop on the running stack (`flywheel demo`).

1. History: MovieLens-100k's ratings before `split` go into Kafka; the Flink job turns them into online
   features (waited for); the catalog (batch features) is loaded.
2. `offline_training` through Airflow on the history: the first @champion, which the ranking server
   (a stack service following the registry) loads by itself.
3. Live: the rest of MovieLens as traffic through the ranking API, one request per session (a user's
   ratings close together in time, as candidates), at `rate` requests/s. The scored items are shown in
   rank order: impressions, and clicks on those the user rated >= 4, go to Kafka now, with the request
   id (the prediction log joins them). `incremental_training` runs on its Airflow cadence from this
   served traffic, promotes versions that pass the gate, and the server follows.
4. Drills, once an incremental version serves: a deliberately bad version (the champion with its
   output inverted) is refused by the gate; the `model_rollback` DAG moves @champion back and the
   server follows.
5. The summary: events, feature freshness, versions and gate decisions, each version's AUC on the
   traffic it served, model freshness, serving latency. Also written to `<data_dir>/demo/`.

Modules by job: `loop` runs the stages; `traffic` generates the live load; `probes` watch features
and the server; `drills` are the bad-model and rollback drills; `summary` collects and prints.
"""

from flywheel.demo.loop import run_loop
from flywheel.demo.plan import LoopError, LoopPlan, Summary
from flywheel.demo.summary import summary_lines

__all__ = ["LoopError", "LoopPlan", "Summary", "run_loop", "summary_lines"]
