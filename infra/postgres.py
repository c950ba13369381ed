"""The local stack's PostgreSQL (the cluster profile's metadata store for Airflow and MLflow): Debian's
server binaries, a private cluster under the data directory.

    python -m infra.postgres init        the cluster, once (its superuser: postgres.username, password file)
    python -m infra.postgres databases   the databases `airflow` and `mlflow`, once the server runs

PostgreSQL refuses to run as root. As root it runs in a user namespace of its own (`unshare --user`),
where it is not root and the files of the data directory are its own: no system account, and nothing
outside the data directory changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from infra.settings import Settings, get_settings, postgres_password

DATABASES = ("airflow", "mlflow")


def bin_dir() -> Path:
    """Debian's server binaries (package postgresql), installed if absent and this is root."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        # Debian's package would create and start a cluster of its own (port 5432): not wanted here.
        conf = Path("/etc/postgresql-common/createcluster.conf")
        if not conf.exists():
            conf.parent.mkdir(parents=True, exist_ok=True)
            conf.write_text("create_main_cluster = false\n")
        subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], check=True,
                       env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"})
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    if not found:
        raise SystemExit("PostgreSQL server binaries not found: apt-get install postgresql")
    return found[-1].parent


def unprivileged() -> list[str]:
    return ["unshare", "--user"] if os.geteuid() == 0 else []


def data_dir(s: Settings) -> Path:
    return s.paths.service_dir("postgres") / "data"


def socket_dir(s: Settings) -> Path:
    return s.paths.service_dir("postgres")


def server_command(s: Settings) -> list[str]:
    host, port = s.postgres.host_port
    return [*unprivileged(), str(bin_dir() / "postgres"), "-D", str(data_dir(s)), "-h", host, "-p", str(port),
            "-k", str(socket_dir(s))]


def init(s: Settings) -> None:
    if (data_dir(s) / "PG_VERSION").exists():
        return
    pwfile = s.paths.service_dir("postgres") / ".initdb-password"
    pwfile.parent.mkdir(parents=True, exist_ok=True)
    pwfile.touch(mode=0o600)
    pwfile.write_text(postgres_password(s) or "")
    try:
        subprocess.run([*unprivileged(), str(bin_dir() / "initdb"), "-D", str(data_dir(s)), "-U", s.postgres.username,
                        "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--locale=C.UTF-8"], check=True)
    finally:
        pwfile.unlink()


def databases(s: Settings) -> None:
    import psycopg2

    host, port = s.postgres.host_port
    conn = psycopg2.connect(host=host, port=port, user=s.postgres.username, password=postgres_password(s),
                            dbname="postgres", connect_timeout=10)
    conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
    with conn.cursor() as cur:
        for name in DATABASES:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{name}"')
                print(f"created database {name}")
    conn.close()


if __name__ == "__main__":
    {"init": init, "databases": databases}[sys.argv[1]](get_settings())
