"""The applier's cache of each target's Delta state (``apply/target_state.py``), on real Delta tables:
trusted only while the log holds nothing this applier did not write or read."""

from __future__ import annotations

import pytest

from cdc_apply.apply.sessionconf import delta_commit_conf
from cdc_apply.apply.target_state import TargetStates
from cdc_apply.apply import delta_internal
from cdc_apply.apply.delta_internal import _scala_map
from cdc_apply.apply.targets import Target
from tests.test_type_roundtrip import captured  # noqa: F401 - the module-scoped capture fixture


def _append(spark, path: str, app_id: str | None, version: int, metadata: str) -> None:  # type: ignore[no-untyped-def]
    with delta_commit_conf(spark, app_id, version, metadata):
        spark.range(2).selectExpr("id", "'x' AS v").write.format("delta").mode("append").save(path)


def test_own_commit_is_trusted_and_anyone_elses_is_read_again(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "t")
    target = Target(spark, path, False)
    states = TargetStates()
    assert states.current(target).exists is False

    spark.range(1).selectExpr("id", "'x' AS v").write.format("delta").save(path)
    first = states.current(target)
    assert first.exists and first.log_version == 0 and first.writers == {}
    assert states.current(target) is first  # nothing new in the log: not read again

    _append(spark, path, "pipe/1", 100, "m1")
    states.wrote(target, first, "pipe/1", 100, "m1")
    mine = states.current(target)
    assert mine.log_version == 1 and mine.writers == {"pipe/1": 100}
    assert states.current(target) is mine

    # A second writer commits: the next batch reads the table's state again and sees it.
    _append(spark, path, "other/1", 7, "m2")
    again = states.current(target)
    assert again is not mine and again.writers == {"pipe/1": 100, "other/1": 7}

    # Our commit lands after someone else's: the log grew by two, so nothing is trusted.
    _append(spark, path, "other/1", 8, "m3")
    _append(spark, path, "pipe/1", 101, "m4")
    states.wrote(target, again, "pipe/1", 101, "m4")
    assert states.current(target).writers == {"pipe/1": 101, "other/1": 8}

    # A commit that is not the one we made (another app id at the next version) is not taken as ours.
    before = states.current(target)
    _append(spark, path, "other/1", 9, "m5")
    states.wrote(target, before, "pipe/1", 102, "m5")
    assert states.current(target).writers["pipe/1"] == 101

    # A schema change by anyone: the column types are read again.
    spark.sql(f"ALTER TABLE delta.`{path}` ADD COLUMNS (w int)")
    assert states.current(target).data_types == {"id": "bigint", "v": "string", "w": "int"}


def test_snapshot_chunk_is_recognised_by_its_commit_info(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "t")
    spark.range(1).selectExpr("id", "'x' AS v").write.format("delta").save(path)
    target = Target(spark, path, False)
    states = TargetStates()
    before = states.current(target)
    _append(spark, path, None, 0, '{"copy": 1}')
    states.wrote(target, before, None, 0, '{"copy": 1}')
    assert states.current(target).log_version == 1
    after = states.current(target)
    _append(spark, path, None, 0, '{"copy": 2}')
    states.wrote(target, after, None, 0, '{"copy": 3}')  # not the metadata we wrote: forgotten
    assert states.current(target) is not after and states.current(target).log_version == 2


@pytest.mark.parametrize("pg_server", ["pg18"], indirect=True)  # Delta's side: one server version is enough
def test_targets_are_compacted_every_n_commits_and_keep_their_rows(captured, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """``optimize_every_commits``: an OPTIMIZE each time the log version passes a multiple; the rows stay."""
    from cdc_apply.apply.batch import BatchApplier
    from cdc_apply.apply.options import ApplyOptions, TableOptions
    from cdc_apply.assemble import Assembler

    columns, _, decoded, captures, _ = captured
    two_dimensional = next(name for name, type_name in columns.items() if type_name == "int4[]")
    options = ApplyOptions(warehouse=str(tmp_path), optimize_every_commits=2,
                           defaults=TableOptions(columns_exclude=(two_dimensional,)))
    applier = BatchApplier(spark, options)
    for transaction in Assembler().transactions(captures[False]):  # one batch per row: one commit each
        applier.apply([transaction])
    path = f"{tmp_path}/public/typed"
    operations = [row["operation"] for row in spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()]
    assert operations.count("OPTIMIZE") >= 1, operations
    assert sorted(r["id"] for r in spark.read.format("delta").load(path).select("id").collect()) == sorted(decoded[False])
    # delta-rs reads the compacted table too, with the same rows.
    import pyarrow as pa
    from deltalake import DeltaTable

    by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(path).scan(columns=["id"])).read_all()
    assert sorted(by_delta_rs.column("id").to_pylist()) == sorted(decoded[False])


def _rebuilt_writers(target: Target) -> dict[str, int]:
    """Delta's own answer, from the table state rebuilt by Spark jobs."""
    empty = target.spark._jvm.scala.Option.empty()
    snapshot = delta_internal.delta_log(target.spark, target.table_location()).update(False, empty, empty)
    return _scala_map(snapshot.transactions(), int)


def _jobs_run_by(spark, group: str, action) -> tuple[object, int]:  # type: ignore[no-untyped-def]
    spark.sparkContext.setJobGroup(group, group)
    try:
        result = action()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    return result, len(spark.sparkContext.statusTracker().getJobIdsForGroup(group))


def test_writer_versions_and_properties_come_from_the_log_files_without_spark(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``apply/delta_log.py`` reads the log's files (Delta's public protocol): no Spark job, the same
    answer as Delta's rebuilt table state, across a checkpoint, and only the new commits on a later read."""
    from cdc_apply.apply import delta_log

    path = str(tmp_path / "t")
    spark.range(1).selectExpr("id", "'x' AS v").write.format("delta").save(path)
    _append(spark, path, "pipe/1", 5, "m1")
    _append(spark, path, "other/1", 9, "m2")
    _append(spark, path, "pipe/1", 6, "m3")
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('cdc_apply.source' = '{{}}', 'x.y' = 'z', "
              "'delta.checkpointInterval' = '3')")

    target = Target(spark, path, False)
    writers, jobs = _jobs_run_by(spark, "writers-from-the-log", target.committed_versions)
    assert writers == {"pipe/1": 6, "other/1": 9}
    assert jobs == 0, "the writers' versions were read with Spark"
    properties, jobs = _jobs_run_by(spark, "properties-from-the-log", target.properties)
    assert jobs == 0
    detail = dict(spark.sql(f"DESCRIBE DETAIL delta.`{path}`").select("properties").first()[0])
    assert properties == detail and properties["x.y"] == "z"
    assert writers == _rebuilt_writers(target)
    assert target.log_version() == 4

    # Later commits, a checkpoint among them: a new process reads the checkpoint and what follows it,
    # this one only the commits since its last read.
    _append(spark, path, "pipe/1", 7, "m4")
    _append(spark, path, "third/1", 1, "m5")
    assert (tmp_path / "t" / "_delta_log" / "_last_checkpoint").exists()
    assert target.committed_versions() == {"pipe/1": 7, "other/1": 9, "third/1": 1} == _rebuilt_writers(target)
    delta_log.forget(path)
    assert Target(spark, path, False).committed_versions() == {"pipe/1": 7, "other/1": 9, "third/1": 1}
    assert Target(spark, path, False).properties() == properties
    assert target.commit_is(6, "third/1", 1, "m5") and not target.commit_is(6, "pipe/1", 7, "m4")

    # The table stays readable by both readers, with the same rows.
    import pyarrow as pa
    from deltalake import DeltaTable

    by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(path).scan(columns=["id", "v"])).read_all()
    assert sorted(zip(by_delta_rs.column("id").to_pylist(), by_delta_rs.column("v").to_pylist())) == \
        sorted((row.id, row.v) for row in spark.read.format("delta").load(path).collect())


def _rows(spark, path: str) -> list[tuple[object, ...]]:  # type: ignore[no-untyped-def]
    import pyarrow as pa
    from deltalake import DeltaTable

    by_spark = sorted(tuple(row) for row in spark.read.format("delta").load(path).collect())
    by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(path).scan()).read_all()
    assert sorted(zip(*(by_delta_rs.column(name).to_pylist() for name in by_delta_rs.column_names))) == by_spark
    return by_spark


def test_an_append_at_a_known_version_records_it_without_rebuilding_the_table_state(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``Target.append_known_version``: one commit with the rows and the SetTransaction, no Spark job
    but the write's own; refused (nothing written) when the log moved or a column does not fit."""
    path = str(tmp_path / "t")
    # A column name that needs column mapping: the append writes physical names as Delta's writer does.
    spark.sql(f"CREATE TABLE delta.`{path}` (id bigint, `a b` string) USING delta "
              "TBLPROPERTIES ('delta.columnMapping.mode' = 'name')")
    target = Target(spark, path, False)
    states = TargetStates()
    known = states.current(target)
    frame = spark.createDataFrame([(1, "x"), (2, "y")], "id bigint, `a b` string")
    spark._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()  # no table state built before the append

    appended, jobs = _jobs_run_by(spark, "append-known", lambda: target.append_known_version(
        frame, "pipe/1", 7, '{"m": 1}', known.log_version))
    assert appended is True
    assert jobs == 1  # the write; Delta's version check would add 3 "Compute snapshot" jobs
    assert states.wrote(target, known, "pipe/1", 7, '{"m": 1}') == known.log_version + 1
    assert _rebuilt_writers(target) == {"pipe/1": 7} == target.committed_versions()
    assert _rows(spark, path) == [(1, "x"), (2, "y")]

    # The log moved past the version the caller read at: nothing is written.
    assert target.append_known_version(frame, "pipe/1", 8, "{}", known.log_version) is False
    # A column the table has not, or of another type: nothing is written.
    now = target.log_version()
    wider = spark.createDataFrame([(3, "z", 1)], "id bigint, `a b` string, extra int")
    other_type = spark.createDataFrame([(3, 4)], "id bigint, `a b` int")
    assert target.append_known_version(wider, "pipe/1", 8, "{}", now) is False
    assert target.append_known_version(other_type, "pipe/1", 8, "{}", now) is False
    assert target.log_version() == now and _rows(spark, path) == [(1, "x"), (2, "y")]
    # Fewer columns than the table: the others read as null, as with Delta's own append.
    assert target.append_known_version(spark.createDataFrame([(4,)], "id bigint"), "pipe/1", 9, "{}", now) is True
    assert _rows(spark, path) == [(1, "x"), (2, "y"), (4, None)]
    assert target.committed_versions() == {"pipe/1": 9}


@pytest.mark.parametrize("pg_server", ["pg18"], indirect=True)  # Delta's side: one server version is enough
def test_targets_checkpoint_every_50_commits_unless_configured(captured, spark, tmp_path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """A new target gets ``delta.checkpointInterval = 50`` from cdc_apply's Spark defaults (Delta's own,
    10, makes every tenth small batch pay a checkpoint); ``target.properties`` and the session's conf
    still decide."""
    from cdc_apply.apply.batch import BatchApplier
    from cdc_apply.apply.options import ApplyOptions, TableOptions
    from cdc_apply.assemble import Assembler

    columns, _, _, captures, _ = captured
    two_dimensional = next(name for name, type_name in columns.items() if type_name == "int4[]")
    first = next(iter(Assembler().transactions(captures[False])))

    def interval(warehouse: str, **options: object) -> str | None:
        applier = BatchApplier(spark, ApplyOptions(warehouse=warehouse, defaults=TableOptions(
            columns_exclude=(two_dimensional,)), **options))  # type: ignore[arg-type]
        applier.apply([first])
        path = f"{warehouse}/public/typed"
        import pyarrow as pa
        from deltalake import DeltaTable

        by_spark = sorted(row["id"] for row in spark.read.format("delta").load(path).select("id").collect())
        by_delta_rs = pa.RecordBatchReader.from_stream(DeltaTable(path).scan(columns=["id"])).read_all()
        assert by_spark and sorted(by_delta_rs.column("id").to_pylist()) == by_spark
        return Target(spark, path, False).properties().get("delta.checkpointInterval")

    assert interval(str(tmp_path / "default")) == "50"
    assert interval(str(tmp_path / "configured"), table_properties={"delta.checkpointInterval": "7"}) == "7"
    session_default = "spark.databricks.delta.properties.defaults.checkpointInterval"
    before = spark.conf.get(session_default)
    spark.conf.set(session_default, "3")
    try:
        assert interval(str(tmp_path / "session")) == "3"
    finally:
        spark.conf.set(session_default, before)


def test_an_append_at_a_known_version_into_partitioned_and_catalog_targets(spark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``tables.<name>.partition_by`` and ``tables.<name>.name`` targets: the rows land in their
    partitions and in the catalog's table, as Delta's own append puts them."""
    path = str(tmp_path / "partitioned")
    spark.sql(f"CREATE TABLE delta.`{path}` (id bigint, region string) USING delta PARTITIONED BY (region)")
    partitioned = Target(spark, path, False)
    frame = spark.createDataFrame([(1, "eu"), (2, "us"), (3, "eu")], "id bigint, region string")
    assert partitioned.append_known_version(frame, "pipe/1", 4, "{}", partitioned.log_version()) is True
    assert _rows(spark, path) == [(1, "eu"), (2, "us"), (3, "eu")]
    assert sorted(p.name for p in (tmp_path / "partitioned").iterdir() if p.name.startswith("region=")) == [
        "region=eu", "region=us"]

    name = "cdc_apply_known_version_by_name"
    spark.sql(f"CREATE TABLE {name} (id bigint, v string) USING delta LOCATION '{tmp_path / 'by_name'}'")
    try:
        by_name = Target(spark, name, True)
        rows = spark.createDataFrame([(7, "x")], "id bigint, v string")
        assert by_name.append_known_version(rows, "pipe/2", 9, "{}", by_name.log_version()) is True
        assert [tuple(r) for r in spark.table(name).collect()] == [(7, "x")]
        assert _rows(spark, str(tmp_path / "by_name")) == [(7, "x")]  # by path, Spark and delta-rs
        assert by_name.committed_versions() == {"pipe/2": 9}
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {name}")
