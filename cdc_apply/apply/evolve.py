"""Carries schema actions out on a Delta target, each as its own commit, before the data MERGE.

Every action first looks at the Delta schema, so repeating it after a crash is a no-op. The commit
info (``userMetadata``) records the action and the LSN of the Relation message that caused it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cdc_apply.apply.schema import (
    AddTargetColumn, BackfillTargetColumn, DropTargetColumn, RenameTargetColumn, RetypeTargetColumn, TargetAction, WidenTargetColumn,
)
from cdc_apply.apply.sessionconf import USER_METADATA, session_conf
from cdc_apply.apply.targets import SOURCE_PROPERTY, SourceState, Target, quote, sql_string

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def commit_metadata(spark: SparkSession, metadata: dict[str, object]):  # type: ignore[no-untyped-def]
    return session_conf(spark, {USER_METADATA: json.dumps(metadata, sort_keys=True)})


def apply_actions(target: Target, actions: Sequence[TargetAction], state: SourceState, lsn: str) -> None:
    spark = target.spark
    for action in actions:
        types = target.column_types()
        with commit_metadata(spark, {"cdc_apply": "schema", "action": repr(action), "lsn": lsn}):
            _apply(target, action, types)
        log.info("%s: %r at LSN %s", target.location, action, lsn)
    with commit_metadata(spark, {"cdc_apply": "source-state", "lsn": lsn}):
        spark.sql(f"ALTER TABLE {target.sql} SET TBLPROPERTIES "
                  f"({sql_string(SOURCE_PROPERTY)} = {sql_string(state.to_json())})")


def _apply(target: Target, action: TargetAction, types: dict[str, str]) -> None:
    spark, table = target.spark, target.sql
    if isinstance(action, AddTargetColumn):
        if action.column not in types:
            spark.sql(f"ALTER TABLE {table} ADD COLUMNS ({quote(action.column)} {action.spark_type})")
    elif isinstance(action, BackfillTargetColumn):
        from cdc_apply.apply.options import COMMIT_LSN

        # The value as a one-row source: a Python value of any Spark type, with no SQL literal to render.
        value = spark.createDataFrame([(action.value,)], f"v {action.spark_type}")
        (target.merge(value, f"t.{quote(COMMIT_LSN)} < {action.before_lsn} AND t.{quote(action.column)} IS NULL")
         .when_matched_update(None, {quote(action.column): "s.v"}).execute())
    elif isinstance(action, WidenTargetColumn):
        if types.get(action.column) != action.spark_type:
            _enable_feature(target, "delta.enableTypeWidening", "true", "typeWidening",
                            f"column {action.column!r} widened to {action.spark_type}")
            spark.sql(f"ALTER TABLE {table} ALTER COLUMN {quote(action.column)} TYPE {action.spark_type}")
    elif isinstance(action, RenameTargetColumn):
        if action.old in types and action.new not in types:
            _enable_column_mapping(target)
            spark.sql(f"ALTER TABLE {table} RENAME COLUMN {quote(action.old)} TO {quote(action.new)}")
    elif isinstance(action, DropTargetColumn):
        if action.column in types:
            _enable_column_mapping(target)
            spark.sql(f"ALTER TABLE {table} DROP COLUMN {quote(action.column)}")
    elif isinstance(action, RetypeTargetColumn):
        if types.get(action.column) != action.spark_type:
            frame = target.read()
            frame = frame.withColumn(action.column, _retyped(frame, action.column, action.spark_type))
            target.write(frame, "overwrite", overwriteSchema="true")


def _retyped(frame, column: str, spark_type: str):  # type: ignore[no-untyped-def]
    """The column's values as ``spark_type``; an array becoming a string is written as PostgreSQL's
    array literal (``{a,"b c",NULL}``), so rows written before the change read like rows after it."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    current = frame.schema[column].dataType
    if spark_type == "string" and isinstance(current, T.ArrayType):
        def element(x):  # type: ignore[no-untyped-def]
            text = x.cast("string")
            # Java regex and replacement syntax: r"\\" matches one backslash, r"\\\\" writes two.
            escaped = F.regexp_replace(F.regexp_replace(text, r"\\", r"\\\\"), '"', r'\\"')
            quoted = F.concat(F.lit('"'), escaped, F.lit('"'))
            needs_quotes = (text == "") | (F.upper(text) == "NULL") | text.rlike(r'[{},"\\\s]')
            return F.when(x.isNull(), F.lit("NULL")).when(needs_quotes, quoted).otherwise(text)

        literal = F.concat(F.lit("{"), F.array_join(F.transform(F.col(quote(column)), element), ","), F.lit("}"))
        return F.when(F.col(quote(column)).isNull(), F.lit(None).cast("string")).otherwise(literal)
    return F.col(quote(column)).cast(spark_type)


def _enable_column_mapping(target: Target) -> None:
    _enable_feature(target, "delta.columnMapping.mode", "name", "columnMapping", "a column renamed or dropped")


def _enable_feature(target: Target, prop: str, value: str, feature: str, because: str) -> None:
    """Switch a reader-visible table feature on, once, at the first change that needs it; say so once."""
    if target.properties().get(prop) == value:
        return
    target.spark.sql(f"ALTER TABLE {target.sql} SET TBLPROPERTIES ({sql_string(prop)} = {sql_string(value)})")
    log.warning("%s: table feature %s switched on (%s); from now on a reader must support %s "
                "(docs/apply.md, \"Readers and table features\")", target.location, feature, because, feature)

