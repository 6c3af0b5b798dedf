"""One collapsed batch of one table -> one Delta MERGE, committed with a transaction identifier.

The source of the MERGE holds one row per key: ``_cdc_op`` is U (upsert) or D (delete), the data
columns, ``_cdc_keep`` (columns whose value stays the target's: unchanged TOAST, or columns the
row's source schema did not have) and the commit LSN and timestamp of the key's last change.

Exactly once: the MERGE runs with ``spark.databricks.delta.write.txnAppId/txnVersion`` set, so
Delta refuses to commit a version it already holds, and the caller drops rows at or below the
version the target already has. An append records the same SetTransaction; when the caller has
just read that the target does not hold the version, it skips Delta's check, which would rebuild
the table state (``Target.append_known_version``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.apply.collapse import Collapsed, Key, freeze, key_image, thaw
from cdc_apply.apply.sessionconf import DataCommit
from cdc_apply.apply.staging import NO_STAGING, Staging, staging_scope
from cdc_apply.apply.columnar import CollapsedColumns
from cdc_apply.apply.key_filter import key_filter
from cdc_apply.apply.options import COMMIT_LSN, COMMIT_TS, DELETED, KEEP, OP, TableOptions
from cdc_apply.apply.targets import Target, quote, sql_string
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgtypes.sparktypes import arrow_type

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

def fetch_target_rows(target: Target, keys: Sequence[str], wanted: Iterable[Key],
                      where: str | None = None) -> dict[Key, dict[str, Any]]:
    """The target rows of the ``wanted`` keys, read to the driver (only for rare cases)."""
    wanted = list(wanted)
    if not wanted:
        return {}
    table = target.read()
    if where:
        table = table.where(where)
    with staging_scope():
        probe, on = _key_probe(target, table, wanted, keys, target.data_types())
        found = table.join(probe, on=on, how="left_semi").collect()
    return {tuple(freeze(_plain(row[k])) for k in keys): row.asDict() for row in found}


def _plain(value: Any) -> Any:
    """A value Spark read (``Row`` for a struct) as the change rows hold it (a dict)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if hasattr(value, "asDict"):
        return {k: _plain(v) for k, v in value.asDict().items()}
    return value


def _key_probe(target: Target, table: DataFrame, wanted: list[Key], keys: Sequence[str],
               data_types: Mapping[str, str]) -> tuple[DataFrame, list[Any]]:
    """The ``wanted`` keys as a DataFrame (``_cdc_i``: the key's index in ``wanted``) and the join
    condition that finds their rows in ``table``: a join, where a filter of one term per key would
    nest too deep for Spark's analyzer (a StackOverflowError at some hundreds of keys)."""
    probe_types = {f"_cdc_k{i}": data_types[name] for i, name in enumerate(keys)}
    arrays = {f"_cdc_k{i}": arrow_column(name, [thaw(key[i]) for key in wanted], data_types[name])
              for i, name in enumerate(keys)}
    arrays["_cdc_i"] = pa.array(range(len(wanted)), pa.int64())
    probe = typed_frame(target.spark, arrays, probe_types, target.staging)
    return probe, [table[quote(k)].eqNullSafe(probe[f"_cdc_k{i}"]) for i, k in enumerate(keys)]


def fill_from_other_rows(target: Target, collapsed: Collapsed, keys: Sequence[str]) -> None:
    """Unchanged TOAST values of rows whose key changed in this batch come from the old key's target row."""
    wanted = collapsed.needs_target_rows()
    if not wanted:
        return
    found = fetch_target_rows(target, keys, wanted)
    for source_key, dependents in wanted.items():
        old_row = found.get(source_key, {})
        for key in dependents:
            state = collapsed.states[key]
            for name in state.from_target:
                state.values[name] = old_row.get(name)
            state.from_target, state.source_key = (), None


def source_frame(spark: SparkSession, collapsed: Collapsed, data_types: Mapping[str, str],
                 staging: Staging = NO_STAGING) -> DataFrame:
    columns: dict[str, list[Any]] = {name: [] for name in data_types}
    ops: list[str] = []
    keeps: list[list[str] | None] = []
    lsns: list[int] = []
    timestamps: list[int] = []
    for state in collapsed.states.values():
        values = state.values
        for name, column in columns.items():
            column.append(values.get(name))
        ops.append("D" if state.deleted else "U")
        keep = list(state.from_target)
        if not state.deleted:
            keep += [name for name in columns if name not in values and name not in keep]
        keeps.append(keep or None)
        lsns.append(state.commit_lsn)
        timestamps.append(state.commit_ts)
    arrays = {name: arrow_column(name, values, data_types[name]) for name, values in columns.items()}
    arrays[OP] = pa.array(ops, pa.string())
    arrays[KEEP] = pa.array(keeps, pa.list_(pa.string()))
    arrays[COMMIT_LSN] = pa.array(lsns, pa.int64())
    arrays[COMMIT_TS] = pa.array(timestamps, pa.timestamp("us", tz="UTC"))
    return typed_frame(spark, arrays, data_types, staging)


def typed_frame(spark: SparkSession, arrays: Mapping[str, pa.Array], data_types: Mapping[str, str],
                staging: Staging = NO_STAGING) -> DataFrame:
    """A DataFrame of Arrow columns, the data columns cast to the target's types. A large one is
    staged as Parquet (``staging``): inside a ``staging_scope`` around the commands that read it."""
    from pyspark.sql import functions as F

    table = pa.table(dict(arrays))
    frame = staging.frame(spark, table)
    # Arrow cannot say timestamp_ntz or every Spark type exactly: cast to the target's types.
    # The table's names are the frame's: no schema round trip (an analysis on a Connect server).
    return frame.select([F.col(quote(n)).cast(data_types[n]).alias(n) if n in data_types else F.col(quote(n))
                         for n in table.column_names])


def arrow_column(name: str, values: list[Any], spark_type: str) -> pa.Array:
    kind = arrow_type(spark_type)
    try:
        return pa.array(values, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        # Values decoded under an earlier source type (a type change inside this batch): cast each.
        return pa.array([_cast(name, value, kind, spark_type) for value in values], kind)


def _cast(name: str, value: Any, kind: pa.DataType, spark_type: str) -> Any:
    try:
        return pa.scalar(value, kind).as_py()
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
        try:
            return pa.scalar(value).cast(kind).as_py()
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
            raise ValueDoesNotFitError(name, f"column {name!r}: value {str(value)[:80]} does not fit the target type "
                                             f"{spark_type} (multi-dimensional arrays need an array column of depth "
                                             f"one): {exc}") from None


class ValueDoesNotFitError(CdcApplyError):
    """A decoded value the target column's type cannot hold (a multi-dimensional array)."""

    def __init__(self, column: str, message: str) -> None:
        super().__init__(message)
        self.column = column


def merge_collapsed(target: Target, collapsed: Collapsed, data_types: Mapping[str, str], keys: Sequence[str],
                    options: TableOptions, commit: DataCommit, append: bool = False,
                    columnar: CollapsedColumns | None = None, frame: DataFrame | None = None) -> None:
    """One Delta commit. ``append``: every row is new to the table (initial snapshot chunks, or a
    batch of new rows only: ``Collapsed.new_rows_only``), so a plain append writes it. ``columnar``:
    the batch collapsed as columns already (``apply/columnar.py``), in place of ``collapsed``'s states;
    ``frame``: collapsed by Spark, the same columns as a DataFrame."""
    with staging_scope():
        _merge_collapsed(target, collapsed, data_types, keys, options, commit, append, columnar, frame)


def _merge_collapsed(target: Target, collapsed: Collapsed, data_types: Mapping[str, str], keys: Sequence[str],
                     options: TableOptions, commit: DataCommit, append: bool, columnar: CollapsedColumns | None,
                     frame: DataFrame | None) -> None:
    spark = target.spark
    key_values: Mapping[str, Iterable[Any]] = {}
    if frame is not None:
        source, kept = frame, frozenset(name for name in data_types if name not in keys)
    elif columnar is not None:
        source = typed_frame(spark, columnar.columns, data_types, target.staging)
        kept = columnar.kept
        key_values = {key: pc.unique(columnar.columns[key]).to_pylist() for key in keys if key in columnar.columns}
    elif collapsed.multiplicity is not None:
        _write_multiset(target, collapsed, data_types, keys, commit)
        return
    else:
        if not append:
            fill_from_other_rows(target, collapsed, keys)
        source = source_frame(spark, collapsed, data_types, target.staging)
        kept = frozenset(name for state in collapsed.states.values() if not state.deleted
                         for name in (*state.from_target, *(n for n in data_types if n not in state.values)))
        if tuple(collapsed.key_columns) == tuple(keys):
            key_values = {key: [state_key[i] for state_key in collapsed.states] for i, key in enumerate(keys)}
    if not keys or append:
        _append(target, commit, new_rows(source, options), overwrite=collapsed.truncate is not None)
        return
    # A truncate deletes every row the batch does not hold: that MERGE reads the whole table anyway.
    where = None if collapsed.truncate is not None or not options.key_filter else \
        key_filter(keys, data_types, key_values)
    with commit.checked(spark):
        _merge(target, source, collapsed, data_types, keys, options, kept, where)


def _append(target: Target, commit: DataCommit, rows: DataFrame, overwrite: bool = False) -> None:
    """``rows`` appended (or, for a truncate, written over the table) in ``commit``: without Delta's
    check of the version when the caller vouches for it (``commit.unwritten_at``), else with it."""
    if not overwrite and commit.app_id is not None and commit.unwritten_at is not None \
            and target.append_known_version(rows, commit.app_id, commit.version, commit.user_metadata,
                                            commit.unwritten_at):
        return
    target.write(rows, "overwrite" if overwrite else "append", **commit.write_options())


def new_rows(source: DataFrame, options: TableOptions) -> DataFrame:
    """The rows an append writes: new rows (and tables without a key, REPLICA IDENTITY NOTHING:
    inserts only), in the target's columns."""
    from pyspark.sql import functions as F

    rows = source.where(f"{OP} = 'U'").drop(OP, KEEP)
    return rows.withColumn(DELETED, F.lit(False)) if options.delete_mode == "soft" else rows


def _write_multiset(target: Target, collapsed: Collapsed, data_types: Mapping[str, str], keys: Sequence[str],
                    commit: DataCommit) -> None:
    """Whole-row keys with a count each (``Collapsed.multiplicity``): identical rows stay apart.

    Rows added are appended as copies. For a key that loses rows, the target's count of it is read
    first; then one MERGE deletes its rows (a source row with ``_cdc_op = 'D'``) and inserts the
    copies that remain (``'U'`` rows, which the ON clause never matches). A truncate overwrites."""
    counts = collapsed.multiplicity or {}
    states = collapsed.states
    entries: list[tuple[dict[str, Any], str, int, int]] = []

    def copies(key: Key, number: int) -> None:
        state = states[key]
        values = key_image(keys, key) | {k: v for k, v in state.values.items() if k not in keys}
        entries.extend([(values, "U", state.commit_lsn, state.commit_ts)] * number)

    where = f"{target.location} (LSN {format_lsn(collapsed.first_lsn or 0)}..{format_lsn(collapsed.last_lsn or 0)})"
    if collapsed.truncate is not None:
        for key, delta in counts.items():
            if delta < 0:
                raise CdcApplyError(f"{where}: a row removed after the truncate was never there")
            copies(key, delta)
        _append(target, commit, _entries_frame(target, entries, data_types).drop(OP), overwrite=True)
        return
    removing = [key for key, delta in counts.items() if delta < 0]
    current = _target_counts(target, removing, keys, data_types) if removing else {}
    for key, delta in counts.items():
        if delta > 0:
            copies(key, delta)
    for key in removing:
        remaining = current.get(key, 0) + counts[key]
        if remaining < 0:
            raise CdcApplyError(f"{where}: removes {-counts[key]} row(s) of a value the target holds "
                                f"{current.get(key, 0)} time(s); the target is out of step (copy it again)")
        copies(key, remaining)
        state = states[key]
        entries.append((key_image(keys, key), "D", state.commit_lsn, state.commit_ts))
    source = _entries_frame(target, entries, data_types)
    if not removing:
        _append(target, commit, source.drop(OP))
        return
    condition = " AND ".join(f"t.{quote(k)} <=> s.{quote(k)}" for k in keys) + f" AND s.{OP} = 'D'"
    inserts = {quote(name): f"s.{quote(name)}" for name in [*data_types, COMMIT_LSN, COMMIT_TS]}
    with commit.checked(target.spark):
        (target.merge(source, condition)
         .when_matched_delete().when_not_matched_insert(f"s.{OP} = 'U'", inserts).execute())


def _entries_frame(target: Target, entries: list[tuple[dict[str, Any], str, int, int]],
                   data_types: Mapping[str, str]) -> DataFrame:
    arrays = {name: arrow_column(name, [values.get(name) for values, _, _, _ in entries], data_types[name])
              for name in data_types}
    arrays[OP] = pa.array([op for _, op, _, _ in entries], pa.string())
    arrays[COMMIT_LSN] = pa.array([lsn for _, _, lsn, _ in entries], pa.int64())
    arrays[COMMIT_TS] = pa.array([ts for _, _, _, ts in entries], pa.timestamp("us", tz="UTC"))
    return typed_frame(target.spark, arrays, data_types, target.staging)


def _target_counts(target: Target, wanted: list[Key], keys: Sequence[str],
                   data_types: Mapping[str, str]) -> dict[Key, int]:
    """How many target rows hold each of the ``wanted`` whole-row keys (a join on the driver's keys)."""
    from pyspark.sql import functions as F

    table = target.read()
    with staging_scope():
        probe, on = _key_probe(target, table, wanted, keys, data_types)
        found = (table.join(probe, on=on, how="inner").groupBy(probe["_cdc_i"])
                 .agg(F.count(F.lit(1)).alias("n")).collect())
    return {wanted[row["_cdc_i"]]: int(row["n"]) for row in found}


def _merge(target: Target, source: DataFrame, collapsed: Collapsed, data_types: Mapping[str, str],
           keys: Sequence[str], options: TableOptions, kept: frozenset[str], where: str | None) -> None:
    """``kept``: the columns some upsert leaves as the target holds them (named in its ``_cdc_keep``);
    ``where``: the key filter on the target (``apply/key_filter.py``)."""
    soft = options.delete_mode == "soft"
    condition = " AND ".join(f"t.{quote(k)} <=> s.{quote(k)}" for k in keys) + (f" AND {where}" if where else "")
    updates: dict[str, str] = {}
    for name in data_types:
        value = f"s.{quote(name)}"
        if name in kept:
            value = (f"CASE WHEN array_contains(coalesce(s.{KEEP}, CAST(array() AS array<string>)), "
                     f"{sql_string(name)}) THEN t.{quote(name)} ELSE {value} END")
        updates[quote(name)] = value
    meta = {quote(COMMIT_LSN): f"s.{COMMIT_LSN}", quote(COMMIT_TS): f"s.{COMMIT_TS}"}
    inserts = {quote(name): f"s.{quote(name)}" for name in data_types} | meta
    meta_live = meta | {quote(DELETED): "false"} if soft else meta
    if soft:
        inserts[quote(DELETED)] = "false"
    merge = target.merge(source, condition)
    if soft:
        merge = merge.when_matched_update(f"s.{OP} = 'D'", meta | {quote(DELETED): "true"})
    else:
        merge = merge.when_matched_delete(f"s.{OP} = 'D'")
    merge = merge.when_matched_update(f"s.{OP} = 'U'", updates | meta_live)
    merge = merge.when_not_matched_insert(f"s.{OP} = 'U'", inserts)
    if collapsed.truncate is not None:
        if soft:
            mark = collapsed.truncate
            merge = merge.when_not_matched_by_source_update(
                f"NOT t.{DELETED}", {quote(DELETED): "true", quote(COMMIT_LSN): str(mark.commit_lsn),
                                     quote(COMMIT_TS): f"timestamp_micros({mark.commit_ts})"})
        else:
            merge = merge.when_not_matched_by_source_delete()
    merge.execute()

