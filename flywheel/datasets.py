"""Which dataset's stack a command acts on, as the CLI names it (`--dataset`): light enough for `flywheel
status` and `up`, which must not pay for the demo's imports (MLflow, pandas)."""

from __future__ import annotations

from infra.settings import REPO_ROOT, DatasetSettings, Settings


def dataset_flag(s: Settings) -> str:
    """What points `flywheel up/down/status` at this dataset's stack: "" for the default dataset's, else
    " --dataset <bundled name or the spec's path>"."""
    if s.spec.path.resolve() == DatasetSettings().spec.resolve():
        return ""
    bundled = s.spec.path.resolve().parent
    return f" --dataset {bundled.name if bundled.parent == (REPO_ROOT / 'datasets').resolve() else s.spec.path}"


def stop_command(s: Settings) -> str:
    """What stops this stack: `make down` for the default dataset's, else `flywheel down --dataset ...`."""
    return f".venv/bin/flywheel down{dataset_flag(s)}" if dataset_flag(s) else "make down"
