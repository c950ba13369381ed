#!/usr/bin/env bash
# Installs everything Flywheel needs on a fresh machine, from the committed lock files:
# uv (pinned) -> platform env (.venv) -> Flink env (.venv-flink) -> the Kafka broker's jars and the Flink
# Kafka connector's (Maven Central, checked against infra/jars.toml) -> the stream job's Java functions
# (streaming/java, built against the Flink env's jars).
# Idempotent: a second run checks and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.8
export UV_PYTHON_DOWNLOADS=never  # managed Pythons come from a host that is out of reach
export UV_LINK_MODE=copy
PYTHON=${FLYWHEEL_BOOTSTRAP_PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "setup: Python 3.11 is required ($PYTHON is $("$PYTHON" --version 2>&1))" >&2; exit 1; }
command -v java >/dev/null && command -v javac >/dev/null \
  || { echo "setup: a Java 17 JDK is required for Flink and the stream job's functions (apt-get install openjdk-17-jdk-headless)" >&2; exit 1; }

if [ ! -x .tools/bin/uv ] || [ "$(.tools/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  "$PYTHON" -m venv .tools
  .tools/bin/pip install --quiet --disable-pip-version-check "uv==$UV_VERSION"
fi
UV=.tools/bin/uv

# Bytecode compiled at install: every Airflow task, stage process and test imports TensorFlow, MLflow
# and Feast; from source (no cache, or PYTHONDONTWRITEBYTECODE set) that alone is ~35 s of CPU per process.
"$UV" sync --frozen --quiet --compile-bytecode --python "$PYTHON"
UV_PROJECT_ENVIRONMENT="$PWD/.venv-flink" "$UV" sync --frozen --quiet --compile-bytecode --python "$PYTHON" --project infra/envs/flink
.venv/bin/python -m infra.kafka_broker install
.venv/bin/python -m infra.flink_jars "$(.venv-flink/bin/python -c 'import pyflink, os; print(os.path.join(os.path.dirname(pyflink.__file__), "lib"))')"
echo "setup: platform env .venv, flink env .venv-flink ready"
