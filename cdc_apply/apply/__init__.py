"""Spark side of cdc_apply: session, collapse, merge, schema evolution, and the foreachBatch apply."""

from cdc_apply.apply.session import build_spark_session


def foreach_batch(config):  # type: ignore[no-untyped-def]
    """``writeStream.foreachBatch(foreach_batch(config))``; see ``cdc_apply.apply.foreach``."""
    from cdc_apply.apply.foreach import foreach_batch as build

    return build(config)


__all__ = ["build_spark_session", "foreach_batch"]
