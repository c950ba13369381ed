"""Two scenarios served by one server (`make bench-scenarios`): wrk, a client the project did not write, against the
ranking API with the same bodies all naming one scenario, then split between two, interleaved, twice each.

Self-contained like `make bench-serving` (Kafka, Redis and MLflow of its own on free ports; its world of 943 users
and 1,682 items; benchmarks/serving.py `_world`), with the default dataset spec plus two scenarios, `home` and
`browse`, each with its own registered ranker (the same trained network, registered under each name: what is
measured is the serving tier holding and batching two champions, not the networks). The bar: split between the
two, total candidates/s >= 0.9 x one scenario alone, 0 non-2xx. The headline's last line:
`scenarios: split R candidates/s, one alone A candidates/s, ratio X`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path

import mlflow
import numpy as np

from benchmarks.serving import Server, _request, _world
from infra import stack
from infra.settings import REPO_ROOT, load_settings
from models.registry import CHAMPION, connect, log_model

SCENARIOS = ("home", "browse")
LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {%s}
local i = 0
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, "/rank", nil, bodies[i])
end
done = function(summary, latency, requests)
  io.write(string.format("RESULT %%d %%f %%f %%f %%d\\n", summary.requests, summary.duration / 1e6,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, summary.errors.status))
end
"""


def _script(tmp: Path, name: str, bodies: list[dict]) -> Path:
    path = tmp / f"{name}.lua"
    path.write_text(LUA % ",\n".join(f"[[{json.dumps(b)}]]" for b in bodies))
    return path


def _wrk(url: str, script: Path, seconds: int, connections: int, rows: float) -> dict[str, float]:
    out = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url],
                         capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    result = next(line for line in out.splitlines() if line.startswith("RESULT"))
    requests, duration, p50, p99, non2xx = result.split()[1:]
    rate = int(requests) / float(duration)
    return {"req_s": rate, "candidates_s": rate * rows, "p50": float(p50), "p99": float(p99), "non2xx": int(non2xx)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=20, help="Length of each wrk run.")
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-scenarios-"))
    spec = tmp / "dataset.toml"
    spec.write_text((REPO_ROOT / "datasets" / "movielens" / "dataset.toml").read_text()
                    + "".join(f"\n[scenarios.{name}]\n" for name in SCENARIOS))
    s = load_settings(os.environ | stack.side_by_side_environ(tmp) | {
        "FLYWHEEL_CONFIG": os.devnull, "FLYWHEEL_STACK_SERVICES": "kafka,redis,mlflow",
        "FLYWHEEL_DATASET_SPEC": str(spec)})
    stack.up(s)
    try:
        model, v1, _ = _world(s, tmp)
        export = model.save(tmp / "scenario-export")
        for name in SCENARIOS:
            ranker = s.scenarios[name]
            mlflow.set_experiment(ranker.experiment)
            with mlflow.start_run(run_name=name):
                version = log_model(s, export, {"kind": "ranker"}, model=ranker)
            connect(s).set_registered_model_alias(ranker.name, CHAMPION, version)
        rng = np.random.default_rng(3)
        bodies = [_request(rng) for _ in range(50)]  # serve-capacity's shape: 50 fixed requests, 10-500 candidates
        rows = float(np.mean([len(b["candidates"]) for b in bodies]))
        scripts = {"one scenario alone": _script(tmp, "alone", [b | {"scenario": "home"} for b in bodies]),
                   "split between two": _script(tmp, "split", [b | {"scenario": SCENARIOS[k % 2]}
                                                               for k, b in enumerate(bodies)])}
        server = Server(s)
        try:
            for name in SCENARIOS:  # both champions loaded and warm before anything is timed
                _wrk(server.url, _script(tmp, f"warm-{name}", [b | {"scenario": name} for b in bodies[:5]]), 3, 2,
                     rows)
            runs: dict[str, list[dict]] = {label: [] for label in scripts}
            for _ in range(2):  # interleaved: the machine's drift falls on both alike
                for label, script in scripts.items():
                    runs[label].append(_wrk(server.url, script, args.seconds, args.connections, rows))
                    print(f"{label}: {runs[label][-1]}", flush=True)
        finally:
            server.close()
    finally:
        stack.down(s)
    mean = {label: {k: float(np.mean([r[k] for r in rs])) for k in rs[0]} for label, rs in runs.items()}
    print(f"\nwrk -t2 -c{args.connections} -d{args.seconds}s, 50 bodies of {rows:.1f} candidates on average, two runs "
          f"each, interleaved; champion v{v1} of the platform's ranker beside the scenarios'.\n")
    print("| bodies | req/s | candidates/s | p50 ms | p99 ms | non-2xx | each run's candidates/s |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for label, m in mean.items():
        each = " / ".join(f"{r['candidates_s']:,.0f}" for r in runs[label])
        print(f"| {label} | {m['req_s']:.1f} | {m['candidates_s']:,.0f} | {m['p50']:.1f} | {m['p99']:.1f} | "
              f"{m['non2xx']:.0f} | {each} |")
    split, alone = mean["split between two"]["candidates_s"], mean["one scenario alone"]["candidates_s"]
    print(f"\nscenarios: split {split:,.0f} candidates/s, one alone {alone:,.0f} candidates/s, "
          f"ratio {split / alone:.3f}")


if __name__ == "__main__":
    main()
