"""S3 for tests: moto's real HTTP server on loopback (`s3_endpoint`, a fixture in tests/conftest.py), and the
environment every component reads its store and event log from (`use_bucket`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port); yields its URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


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
