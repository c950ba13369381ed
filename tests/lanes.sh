#!/usr/bin/env bash
# `make test`: every test, in two lanes on the two cores. The tests that start services run one after the
# other in one lane (two stacks at once would share the cores with timing checks and double the memory);
# the tests that start none run beside them in the other. Arguments go to both pytest runs. The cluster
# profile's suite (marker `cluster`: ~14 min of a slow 2-core machine) is `make test-cluster`, apart: with it
# the lane ran past CI's 90 min there (the standing check `cluster-profile` proves that profile too).
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
.venv/bin/python -m pytest -ra -p no:cacheprovider -m "not stack" "$@" >"$log" 2>&1 &
fast=$!
trap 'kill "$fast" 2>/dev/null; rm -f "$log"' EXIT  # an interrupted run leaves no lane behind
.venv/bin/python -m pytest -ra --durations=30 -m "stack and not cluster" "$@"
stack=$?
wait "$fast"
fast_rc=$?
echo "=============================== the tests that start no service ==============================="
cat "$log"
ok() { [ "$1" = 0 ] || [ "$1" = 5 ]; }  # 5: the arguments left a lane no test
ok "$stack" || exit "$stack"
ok "$fast_rc" || exit "$fast_rc"
