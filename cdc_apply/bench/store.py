"""The object store a bench measures beside the local disk (``--warehouse``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from cdc_apply.lake.location import Location

LOCAL_S3 = "local-s3"


@dataclass(frozen=True)
class ObjectStore:
    warehouse: str  # a URI under which each run makes its own warehouse
    spark_conf: dict[str, str]  # how Spark and cdc_apply's state reach it

    def under(self, name: str) -> str:
        return str(Location.parse(self.warehouse).child(name))


@contextmanager
def object_store(warehouse: str | None, config_path: str | None = None) -> Iterator[ObjectStore | None]:
    """``warehouse``: None (no store: local disk only), ``local-s3`` (a versitygw the bench starts, on
    this machine's disk), or a URI reached with the ``spark:`` section of ``config_path`` (or the AWS
    default chain)."""
    if warehouse is None:
        yield None
        return
    if warehouse == LOCAL_S3:
        from cdc_apply.s3server import S3Server

        with S3Server() as server:
            server.create_bucket("bench")
            yield ObjectStore("s3a://bench/lake", server.spark_conf())
        return
    Location.parse(warehouse)  # a malformed URI fails here, before any server starts
    conf: dict[str, str] = {}
    if config_path is not None:
        from cdc_apply.config import load_config

        conf = {k: str(v) for k, v in load_config(config_path).spark.items()}
    yield ObjectStore(warehouse, conf)
