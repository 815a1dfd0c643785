"""S3 for tests: moto's real HTTP server on loopback (`moto_server`, the nightly replay's; the fixture
`s3_endpoint` in tests/conftest.py), and the environment every component reads its store and event log from
(`use_bucket`)."""

from __future__ import annotations

import pytest

from pipelines.nightly import local_s3 as moto_server  # noqa: F401 (the tests' S3 server: the replay's)


def use_bucket(monkeypatch: pytest.MonkeyPatch, endpoint: str, bucket: str, prefix: str = "reranker"):
    """Create `bucket` and point the artifact store's settings (GR2_S3_BUCKET, S3_ENDPOINT_URL, credentials)
    at it, as the Secret and ConfigMap do on a cluster. Returns a boto3 client of the bucket's server."""
    from components.artifact_store import s3_client

    for key, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "GR2_S3_BUCKET": bucket,
        "GR2_S3_PREFIX": prefix,
        "S3_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    client = s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    return client
