"""The S3 store's bucket for MLflow's artifacts (`python -m infra.object_store`, once the store runs):
created if missing, so a fresh local store and an empty account alike are ready for the registry."""

from __future__ import annotations

from urllib.parse import urlsplit

from infra.settings import Settings, get_settings, s3_secret_key


def client(s: Settings):
    import boto3

    return boto3.client("s3", endpoint_url=s.s3.endpoint_url, region_name=s.s3.region,
                        aws_access_key_id=s.s3.access_key_id, aws_secret_access_key=s3_secret_key(s))


def ensure_bucket(s: Settings) -> str:
    bucket = urlsplit(s.mlflow.artifacts_uri).netloc
    s3 = client(s)
    if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
        s3.create_bucket(Bucket=bucket)
        print(f"created bucket {bucket}")
    return bucket


if __name__ == "__main__":
    settings = get_settings()
    if urlsplit(settings.mlflow.artifacts_uri).scheme == "s3":  # else nothing of the stack's is kept in S3
        ensure_bucket(settings)
