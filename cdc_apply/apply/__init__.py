"""Spark side of cdc_apply: session, collapse, merge, schema evolution."""

from cdc_apply.apply.session import build_spark_session

__all__ = ["build_spark_session"]
