"""A small client of Airflow's REST API (v2), authenticated with the configured credentials."""

from __future__ import annotations

import time
from typing import Any

import httpx

from infra.settings import Settings, airflow_password

FINISHED = {"success", "failed"}


class AirflowApiError(RuntimeError):
    """Airflow refused a request or did not answer as expected."""


class AirflowClient:
    def __init__(self, s: Settings, timeout_s: float = 30.0):
        self.base = s.airflow.api_url.rstrip("/")
        try:
            answer = httpx.post(f"{self.base}/auth/token", timeout=timeout_s,
                                json={"username": s.airflow.username, "password": airflow_password(s)})
        except httpx.HTTPError as exc:
            raise AirflowApiError(f"Airflow at {self.base} is unreachable ({type(exc).__name__}); "
                                  "is the stack up (`flywheel status`)?") from None
        if answer.status_code not in (200, 201):
            raise AirflowApiError(f"login as {s.airflow.username!r} refused: HTTP {answer.status_code} {answer.text}")
        self.http = httpx.Client(base_url=f"{self.base}/api/v2", timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {answer.json()['access_token']}"})

    def _call(self, method: str, path: str, tries: int = 4, **kwargs: Any) -> dict:
        """One API call. A 500 for a database error is asked again (after 1, 2, 4 s): on SQLite (the default
        profile) the API's write waits 5 s for the scheduler's lock and then fails, and its transaction is
        rolled back, so the request is safe to repeat."""
        for attempt in range(tries):
            answer = self.http.request(method, path, **kwargs)
            if answer.status_code != 500 or "Database error" not in answer.text or attempt == tries - 1:
                break
            time.sleep(2 ** attempt)
        if answer.status_code >= 400:
            raise AirflowApiError(f"{method} {path}: HTTP {answer.status_code} {answer.text[:500]}")
        return answer.json() if answer.content else {}  # a DELETE answers 204, no body

    def wait_for_dag(self, dag_id: str, timeout_s: float = 120.0) -> dict:
        """The DAG once the dag-processor has parsed it (new files take up to its refresh interval)."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.http.get(f"/dags/{dag_id}")
            if answer.status_code == 200:
                return answer.json()
            if time.monotonic() > deadline:
                raise AirflowApiError(f"DAG {dag_id} not known to Airflow after {timeout_s:.0f}s "
                                      f"(HTTP {answer.status_code}); check `flywheel logs airflow-dag-processor`")
            time.sleep(1)

    def set_paused(self, dag_id: str, paused: bool) -> bool:
        """Pause or unpause a DAG; returns whether it was paused before."""
        was = self.wait_for_dag(dag_id)["is_paused"]
        self._call("PATCH", f"/dags/{dag_id}", json={"is_paused": paused})
        return was

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        """Start a run; returns its run id. The DAG is unpaused first (a paused DAG's runs never start),
        which also turns its schedule on."""
        self.set_paused(dag_id, False)
        run = self._call("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def run(self, dag_id: str, run_id: str) -> dict:
        """The run as the API describes it: state, start_date, end_date, conf, ..."""
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}")

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.run(dag_id, run_id)["state"]

    def wait(self, dag_id: str, run_id: str, timeout_s: float = 900.0) -> str:
        """Poll until the run succeeds or fails; its final state. An API server too busy to answer one poll
        (a loaded machine) is asked again, until the deadline."""
        deadline, state = time.monotonic() + timeout_s, "unknown"
        while True:
            try:
                if (state := self.run_state(dag_id, run_id)) in FINISHED:
                    return state
            except httpx.TransportError as exc:
                state = f"unknown (the API did not answer: {type(exc).__name__})"
            if time.monotonic() > deadline:
                raise AirflowApiError(f"{dag_id} run {run_id} still {state} after {timeout_s:.0f}s")
            time.sleep(2)

    def active_runs(self, dag_id: str) -> list[str]:
        """Run ids of the DAG's queued and running runs."""
        return [r["dag_run_id"] for r in self.runs(dag_id, ["queued", "running"])]

    def runs(self, dag_id: str, states: list[str] | None = None, limit: int = 20) -> list[dict]:
        """The DAG's newest `limit` runs (in `states`), as the API describes them (dag_run_id, state,
        queued_at, start_date, ...), newest first."""
        params: dict[str, Any] = {"order_by": "-id", "limit": limit} | ({"state": states} if states else {})
        return self._call("GET", f"/dags/{dag_id}/dagRuns", params=params)["dag_runs"]

    def drop_unstarted(self, dag_id: str, run_id: str, note: str) -> bool:
        """Remove a run no task of which has started (the DAG paused, none will): a queued run is deleted,
        a running one marked failed with `note`. False, and nothing changed, when a task has started."""
        run = self.run(dag_id, run_id)
        if run["state"] == "queued":
            self._call("DELETE", f"/dags/{dag_id}/dagRuns/{run_id}")
            return True
        if run["state"] != "running" or any(state not in (None, "scheduled")
                                            for state in self.task_states(dag_id, run_id).values()):
            return False
        self._call("PATCH", f"/dags/{dag_id}/dagRuns/{run_id}", json={"state": "failed", "note": note})
        return True

    def last_finished_runs(self, limit: int = 200) -> dict[str, dict]:
        """Each DAG's last finished run among the `limit` that ended last: {dag_id: {"state", "end"}}
        (end in epoch seconds). One call for every DAG (`~`)."""
        from datetime import datetime

        runs = self._call("GET", "/dags/~/dagRuns", tries=1, params={
            "state": sorted(FINISHED), "order_by": "-end_date", "limit": limit})["dag_runs"]
        latest: dict[str, dict] = {}
        for r in runs:
            if r["dag_id"] not in latest and r.get("end_date"):
                latest[r["dag_id"]] = {"state": r["state"],
                                       "end": datetime.fromisoformat(r["end_date"]).timestamp()}
        return latest

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        return {t["task_id"]: t["state"] for t in self.task_instances(dag_id, run_id)}

    def task_error(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> str | None:
        """The exception a failed task try ended with ("NoBehavior: ..."), from its structured log; None
        when the log holds none (or cannot be read: the caller still has the task's state)."""
        try:
            log = self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                             params={"full_content": True}, headers={"Accept": "application/json"})
        except (AirflowApiError, httpx.HTTPError, ValueError):
            return None
        found = [e for line in log.get("content", []) if isinstance(line, dict)
                 for e in line.get("error_detail") or [] if isinstance(e, dict) and "exc_type" in e]
        return f"{found[-1]['exc_type']}: {found[-1].get('exc_value', '')}" if found else None

    def failures(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        """Each failed task of a run and its error (task_error)."""
        return {t["task_id"]: self.task_error(dag_id, run_id, t["task_id"], t.get("try_number") or 1)
                for t in self.task_instances(dag_id, run_id) if t["state"] == "failed"}

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        """A task's return value."""
        return self._call("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value",
                          params={"deserialize": True})["value"]
