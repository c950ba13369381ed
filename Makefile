# Flywheel's single entry point. `make demo` runs the platform; `make test` runs the tests.
SHELL := /bin/bash
FLYWHEEL := .venv/bin/flywheel

.PHONY: setup demo demo-shop test test-fast test-cluster chaos up down status serve bench bench-streaming bench-models bench-dags bench-serving bench-scenarios bench-sparse bench-sparse-pull bench-retrieval bench-canary bench-drift bench-served-drift bench-report lock lock-jars clean

setup:  ## install both environments and the Flink connector jars from the lock files
	@bash infra/setup.sh

demo: setup  ## start the local stack and run the platform's main job on it
	$(FLYWHEEL) demo

SHOP ?= .flywheel-shop-data
demo-shop: setup  ## the loop on a synthetic shop of weak signal (list AUC ~0.6: benchmarks/shop.py), its own stack
	.venv/bin/python -m benchmarks.shop $(SHOP) $(ARGS)
	$(FLYWHEEL) demo --dataset $(SHOP)/dataset.toml

test: setup  ## the whole test suite but the cluster profile's (starts the real services it needs), in two lanes
	@bash tests/lanes.sh

test-fast: setup  ## tests that start no service
	.venv/bin/python -m pytest -ra -m "not stack"

test-cluster: setup  ## the cluster profile's suite (not in `make test`): its stack, a shortened loop on it, `down` (~14 min)
	.venv/bin/python -m pytest -ra -p no:cacheprovider -m cluster $(ARGS)

chaos: setup  ## the fault suite (also in `make test`): crashes, outages and stalls on stacks of their own; ends with the fault table
	.venv/bin/python -m pytest -ra -p no:cacheprovider -m chaos $(ARGS)

up: setup
	$(FLYWHEEL) up

down:
	$(FLYWHEEL) down

status:
	$(FLYWHEEL) status

serve: setup  ## the ranking server in the foreground, on the running stack (needs a @champion)
	$(FLYWHEEL) serve

bench: setup  ## producer throughput and stack cold start; figures for docs/benchmarks.md
	.venv/bin/python -m benchmarks.foundation

bench-streaming: setup  ## events/s through Kafka -> Flink -> online store, and feature freshness
	.venv/bin/python -m benchmarks.streaming $(ARGS)

bench-models: setup  ## after `make demo`: ranker vs logistic-regression baseline on MovieLens, incremental run
	.venv/bin/python -m benchmarks.models $(ARGS)

bench-dags: setup  ## edges/s into the graph store; with ARGS=--training (after `make demo`) an incremental run via Airflow
	.venv/bin/python -m benchmarks.dags $(ARGS)

bench-serving: setup  ## model limit vs server throughput at p99 <= 50 ms; batching, buckets, executors on/off; swap time
	.venv/bin/python -m benchmarks.serving $(ARGS)

bench-scenarios: setup  ## wrk against one server: bodies naming one scenario vs split between two, each with its own champion (~4 min)
	.venv/bin/python -m benchmarks.scenarios $(ARGS)

bench-sparse: setup  ## the sparse tier: 50M ids in a Redis of their own served by the real server vs tables in each worker, a 1M-row delta (~10 min, ~8 GB)
	.venv/bin/python -m benchmarks.sparse $(ARGS)

bench-sparse-pull: setup  ## an incremental run's warm start: its window's rows pulled from the store vs its parent whole (~2 min)
	.venv/bin/python -m benchmarks.sparse_pull $(ARGS)

bench-retrieval: setup  ## recall@20 / NDCG@20 of two-tower, graph, merged and popular candidates beside baselines, on the dataset's split (no stack)
	.venv/bin/python -m benchmarks.retrieval $(ARGS)

bench-canary: setup  ## the canary's false ramps of a 10 %-worse version and lists to ramp an honest one, in simulation (~1 min)
	.venv/bin/python -m benchmarks.canary $(ARGS)

bench-drift: setup  ## the world on a stack of its own: a champion frozen after a warm-up vs the learning one, before and after the world changes (~30 min)
	FLYWHEEL_PATHS_DATA_DIR=$(CURDIR)/.flywheel-drift .venv/bin/flywheel drift --dataset world --fresh --out docs/plots $(ARGS)

bench-served-drift: setup  ## after `make demo`: the first champion's AUC by week on its test part and on the live sessions, features frozen (~1 min)
	.venv/bin/python -m benchmarks.served_drift $(ARGS)

bench-report: setup  ## every suite and the demo, one run: docs/benchmarks.md and docs/plots/*.png (~35 min)
	.venv/bin/python -m benchmarks.report $(ARGS)

lock:  ## re-resolve both lock files after editing a pyproject.toml
	.tools/bin/uv lock
	.tools/bin/uv lock --project infra/envs/flink

lock-jars: setup  ## re-resolve infra/jars.toml (the broker's and the connector's jars, with Maven) after editing its roots
	.venv/bin/python -m infra.maven lock

clean: down
	rm -rf .flywheel
