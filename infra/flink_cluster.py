"""The local Flink session cluster (the cluster profile's "flink" service): a JobManager and
`flink.taskmanagers` TaskManagers of one slot each, from the distribution inside the apache-flink wheel,
each a foreground JVM (the launch scripts exec java), every socket on the REST address's host. The stream
job is submitted to it (flink.target "remote", streaming/job.py) like to any session cluster."""

from __future__ import annotations

import json
from pathlib import Path

from infra.flink_rest import ensure_credentials, ssl_options
from infra.settings import Settings


def flink_home(s: Settings) -> Path:
    return s.paths.flink_python.parent.parent / "lib" / "python3.11" / "site-packages" / "pyflink"


# The stream job's parameter naming the id of the events topic it reads (streaming/job.py sets it; the
# stack's health check compares it with the broker's topic).
EVENTS_TOPIC_ID = "flywheel.events-topic-id"


def rest_options(s: Settings) -> dict[str, str]:
    """The REST endpoint's options, for the session cluster and the job's local MiniCluster alike, and for
    the client that submits to the session cluster: mutual TLS at flink.api_url (infra/flink_rest.py)."""
    host, port = s.flink.api_host_port
    return {
        "rest.address": host, "rest.bind-address": host, "rest.port": str(port),
        "rest.flamegraph.enabled": "true",
        # Flink's default is "*": any web page the user opens could read the job's REST answers.
        "web.access-control-allow-origin": s.flink.rest_url.rstrip("/"),
        # No jar upload or run page in the web UI, no cancel button: jobs come from the platform, the
        # session cluster's through the client's job submission.
        "web.submit.enable": "false", "web.cancel.enable": "false",
        **ssl_options(s),
    }


def conf_dir(s: Settings) -> Path:
    return s.paths.service_dir("flink") / "conf"


def write_config(s: Settings) -> Path:
    """The cluster's config dir: config.yaml (YAML is a superset of JSON: written as JSON), and log4j
    configurations that log to the console only (the stack keeps each process's output in its log)."""
    home, conf, (host, _) = flink_home(s), conf_dir(s), s.flink.api_host_port
    conf.mkdir(parents=True, exist_ok=True)
    ensure_credentials(s)
    java_opts = next(line.split(":", 1)[1].strip() for line in (home / "conf" / "config.yaml").read_text().splitlines()
                     if line.strip().startswith("all: "))  # the JVM flags Flink needs on Java 17
    tmp = s.paths.service_dir("flink") / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    config = {
        "env.java.opts.all": java_opts,
        "env.log.dir": str(s.paths.logs_dir / "flink"),
        "env.pid.dir": str(s.paths.run_dir),
        "jobmanager.bind-host": host, "jobmanager.rpc.address": host, "jobmanager.rpc.port": s.flink.rpc_port,
        "jobmanager.memory.process.size": "768m",
        "jobmanager.execution.failover-strategy": "region",
        "taskmanager.bind-host": host, "taskmanager.host": host, "taskmanager.numberOfTaskSlots": 1,
        "taskmanager.rpc.port": "0", "taskmanager.data.port": 0,
        "taskmanager.memory.process.size": s.flink.process_memory,
        **rest_options(s),
        "blob.server.port": "0", "metrics.internal.query-service.port": "0",
        "io.tmp.dirs": str(tmp),
    }
    path = conf / "config.yaml"  # holds the REST keystore's password: its owner's alone
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text(json.dumps(config, indent=1))
    for name in ("log4j-console.properties", "log4j-cli.properties"):
        lines = (home / "conf" / name).read_text().splitlines()
        (conf / name).write_text("\n".join(line for line in lines if "rolling" not in line.lower()) + "\n")
    return conf


def jobmanager_command(s: Settings) -> list[str]:
    write_config(s)
    return [str(flink_home(s) / "bin" / "jobmanager.sh"), "start-foreground"]


def taskmanager_command(s: Settings) -> list[str]:
    write_config(s)
    return [str(flink_home(s) / "bin" / "taskmanager.sh"), "start-foreground"]


def environ(s: Settings) -> dict[str, str]:
    return {"FLINK_CONF_DIR": str(conf_dir(s)), "FLINK_LOG_DIR": str(s.paths.logs_dir / "flink")}
