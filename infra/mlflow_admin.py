"""The local registry's admin password follows the settings (mlflow.password, else the generated one), as
Airflow's passwords file does: MLflow's basic-auth app takes the configured password only when it first
creates its user store, so a later change of the setting would otherwise lock every client out. Run
before the local MLflow server starts (`python -m infra.mlflow_admin`)."""

from __future__ import annotations

from infra.settings import Settings, get_settings, mlflow_password


def sync_admin(s: Settings) -> None:
    db = s.paths.service_dir("mlflow") / "basic_auth.db"
    password = mlflow_password(s)
    if not db.exists() or not password:  # a new store: the server creates the admin from its config
        return
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore  # ~3 s of imports: only here

    store = SqlAlchemyStore()
    store.init_db(f"sqlite:///{db}")
    user = s.mlflow.username
    if not store.has_user(user):
        store.create_user(user, password, is_admin=True)
    elif not store.authenticate_user(user, password):
        store.update_user(user, password=password, is_admin=True)


if __name__ == "__main__":
    sync_admin(get_settings())
