"""The collapse on Spark's executors: one table's rows of the change log -> the MERGE source, with no
row on the driver (docs/change-log-table.md, "Large transactions on the executors").

A window over (key, commit LSN, seq), run by the collapse every other path uses:

1. Routing (``mapInArrow``): each row's new key and old key (a delete's, or an update's that moved
   the row) converted from the log's text to the target's key types, with the column codecs the
   apply converts with. Spark sends the row to the group of each key it touches,
   ``pmod(hash(key), groups)``.
2. Collapse (``groupBy(group).applyInArrow``): a group's rows turned back into transactions as
   ``foreach_batch`` turns a micro-batch (``micro_batch_changes``: ordered by commit LSN and seq) and
   collapsed by ``apply/columnar.py``. Every change of a key routed to the group is in the group, so
   that key's last state, TOAST carried forward, is exact; the group keeps only its own keys (the
   other key of a moved row is another group's).
3. The groups' rows are the MERGE source (``apply/merge.py``), read once by the MERGE.

A group the columnar collapse refuses (a row moved to another key with unchanged TOAST values, a
key column of floating point) fails the job with ``CollapseRefused`` before anything is committed:
the caller applies the table on the driver instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import pyarrow as pa

from cdc_apply.apply.columnar import collapsed_columns, segment_rows
from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS, KEEP, MAX_PIECE_BYTES, OP
from cdc_apply.apply.targets import quote
from cdc_apply.changerows.codec import PortableCodec
from cdc_apply.changerows.columns import text_column
from cdc_apply.changerows.segments import ChangeRowBuilder
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgtypes.sparktypes import arrow_type
from cdc_apply.spark.foreach import APPLY_COLUMNS, ROW_COLUMNS, micro_batch_changes
from cdc_apply.spark.typed import spark_arrow

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

GROUP = "_cdc_group"
REFUSED = "cdc_apply: the executors' collapse refused a group"


class CollapseRefused(CdcApplyError):
    """The columnar collapse cannot take a group's rows; the driver's collapse must."""


def groups_for(message_bytes: int, parallelism: int) -> int:
    """Enough groups that each holds about one piece of messages (what a task holds at once)."""
    return max(parallelism, math.ceil(message_bytes / MAX_PIECE_BYTES))


def collapse_on_executors(rows: DataFrame, codec: PortableCodec, column_map: Mapping[str, str | None],
                          keys: tuple[str, ...], data_types: Mapping[str, str], after_lsn: int | None,
                          groups: int) -> DataFrame:
    """``rows``: the change log's rows of ``codec``'s table under that one Relation definition, no
    truncate among them. The result: one row per key changed after ``after_lsn``, as target columns
    plus ``OP``, ``KEEP``, the commit LSN and timestamp (the MERGE source of ``apply/merge.py``)."""
    from pyspark.sql import functions as F

    source_of = {target: source for source, target in column_map.items() if target is not None}
    key_types = [data_types[k] for k in keys]
    rows = rows.select(*APPLY_COLUMNS, *ROW_COLUMNS)
    if after_lsn is not None:
        rows = rows.where(F.col("commit_lsn") > after_lsn)
    texts = [F.element_at("new", F.lit(source_of[k])).alias(f"_cdc_new_text{i}") for i, k in enumerate(keys)]
    texts += [F.coalesce(F.element_at("key", F.lit(source_of[k])), F.element_at("old", F.lit(source_of[k])))
              .alias(f"_cdc_old_text{i}") for i, k in enumerate(keys)]
    with_texts = rows.select("*", *texts)
    typed_fields = [f"_cdc_new{i} {t}" for i, t in enumerate(key_types)] + \
                   [f"_cdc_old{i} {t}" for i, t in enumerate(key_types)]
    passed = [f"{quote(field.name)} {field.dataType.simpleString()}" for field in rows.schema.fields]
    keyed = with_texts.mapInArrow(_key_converter(codec, [source_of[k] for k in keys], key_types),
                                  ", ".join([*passed, *typed_fields]))
    new_group = _group([F.col(f"_cdc_new{i}") for i in range(len(keys))], groups)
    old_group = _group([F.col(f"_cdc_old{i}") for i in range(len(keys))], groups)
    moved = (F.col("op") == "D") | F.col("key").isNotNull() | F.col("old").isNotNull()
    routed = keyed.select(*[F.col(quote(c)) for c in rows.columns], F.explode(F.array_distinct(F.filter(
        F.array(F.when(F.col("op") != "D", new_group), F.when(moved, old_group)), lambda g: g.isNotNull())))
        .alias(GROUP))
    output = [f"{quote(name)} {spark_type}" for name, spark_type in data_types.items()]
    output += [f"{OP} string", f"{KEEP} array<string>", f"{COMMIT_LSN} bigint", f"{COMMIT_TS} timestamp",
               f"{GROUP} int"]
    collapsed = routed.groupBy(GROUP).applyInArrow(
        _group_collapser(codec, dict(column_map), keys, dict(data_types)), ", ".join(output))
    own = _group([F.col(quote(k)) for k in keys], groups) == F.col(GROUP)
    return collapsed.where(own).drop(GROUP)


def _group(columns: list[Column], groups: int) -> Column:
    from pyspark.sql import functions as F

    return F.pmod(F.hash(*columns), F.lit(groups))


def _key_converter(portable: PortableCodec, sources: list[str], key_types: list[str]):  # noqa: ANN202 - a Spark task
    """The routing step's task: the key texts (``_cdc_new_text<i>``, ``_cdc_old_text<i>``) converted with
    the key columns' codecs and cast to the target's key types (``_cdc_new<i>``, ``_cdc_old<i>``)."""
    table = f"{portable.relation.namespace}.{portable.relation.name}"

    def convert(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        columns = {column.name: column for column in portable.build().columns}
        for batch in batches:
            lsns = batch.column("commit_lsn")

            def where(row: int) -> str:
                return f"{table}, the change log's row of LSN {format_lsn(lsns[row].as_py())}"

            arrays, names = [], []
            for name in batch.schema.names:
                if not name.startswith(("_cdc_new_text", "_cdc_old_text")):
                    arrays.append(batch.column(name))
                    names.append(name)
            for side in ("new", "old"):
                for i, (source, spark_type) in enumerate(zip(sources, key_types)):
                    raw = batch.column(f"_cdc_{side}_text{i}").cast(pa.large_binary())
                    arrays.append(text_column(raw, columns[source], where).cast(spark_arrow(arrow_type(spark_type))))
                    names.append(f"_cdc_{side}{i}")
            yield pa.RecordBatch.from_arrays(arrays, names=names)

    return convert


def _group_collapser(portable: PortableCodec, column_map: dict[str, str | None], keys: tuple[str, ...],
                     data_types: dict[str, str]):  # noqa: ANN202 - a Spark task
    """The collapse step's task: one group's rows -> its keys' last states (see the module docstring)."""
    schema = pa.schema([*(pa.field(name, spark_arrow(arrow_type(kind))) for name, kind in data_types.items()),
                        pa.field(OP, pa.string()), pa.field(KEEP, pa.list_(pa.string())),
                        pa.field(COMMIT_LSN, pa.int64()), pa.field(COMMIT_TS, pa.timestamp("us", tz="UTC")),
                        pa.field(GROUP, pa.int32())])

    def collapse(rows: pa.Table) -> pa.Table:
        if rows.num_rows == 0:
            return schema.empty_table()
        group = rows.column(GROUP)[0].as_py()
        codec = portable.build()
        transactions, parsed = micro_batch_changes(rows.select([*APPLY_COLUMNS, *ROW_COLUMNS]))
        builder = ChangeRowBuilder.with_codecs([codec])
        segments = builder.build(transactions, parsed)
        seeded = len(segments) == 1 and segments[0].codec is codec  # not one built without the config's types
        table = segment_rows(segments[0]) if seeded else None
        collapsed = None if table is None else collapsed_columns(table, None, column_map, keys, data_types)
        if collapsed is None:
            name = f"{portable.relation.namespace}.{portable.relation.name}"
            raise CollapseRefused(f"{REFUSED} of {name} (a row moved to another key with unchanged TOAST values, "
                                  "or a key the columnar collapse cannot group)")
        count = len(collapsed.columns[OP])
        columns = [collapsed.columns[field.name].cast(field.type) for field in schema if field.name != GROUP]
        return pa.Table.from_arrays([*columns, pa.array([group] * count, pa.int32())], schema=schema)

    return collapse
