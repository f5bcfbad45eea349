"""Shared fixtures for the DiLoCo tests: a real S3 API (moto server) on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A ThreadedMotoServer on 127.0.0.1 (S3, SageMaker, CloudWatch Logs...), stopped after."""
    pytest.importorskip("moto.server", reason="needs moto[server]")
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, moto_endpoint: str) -> str:
    """Dummy credentials so no real AWS account is ever used; returns the endpoint URL."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    return moto_endpoint


@pytest.fixture
def s3_bucket(aws_env: str) -> tuple[str, dict[str, Any]]:
    """A fresh bucket on the moto server: ``(s3://bucket, fsspec storage_options)``."""
    import uuid

    import boto3

    name = f"diloco-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=aws_env, region_name="us-east-1").create_bucket(Bucket=name)
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": aws_env, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }
    return f"s3://{name}", options
