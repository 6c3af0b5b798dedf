"""Golden vectors captured here from real servers: every message type, every protocol, text and binary.

The oracle: decoding + assembling each capture and replaying it with the reference applier must
reproduce the PostgreSQL tables value by value.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import psycopg
import pyarrow as pa
import pytest

from cdc_apply.assemble import Assembler
from cdc_apply.changerows.segments import ChangeRowBuilder, change_rows
from cdc_apply.errors import CdcApplyError
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import PgOutputDecoder
from cdc_apply.sources.slot import server_version_num
from cdc_apply.spark.foreach import micro_batch_changes
from cdc_apply.spark.rows import SOURCE_SCHEMA, record_batches, typed_schema
from cdc_apply.spark.typed import images_from_relations
from tests.capture_helpers import peek
from tests.conftest import fresh_database
from tests.rows_compare import assert_columnar_matches_scalar, normalised
from tests.reference_apply import ReferenceTables, postgres_rows
from tests.workloads import TABLES, run_golden_workload, variants


@pytest.fixture(scope="module")
def golden(pg_server):  # type: ignore[no-untyped-def]
    """One capture run per server version, shared by this module's tests (origins are cluster-wide)."""
    for server, dbname in fresh_database(pg_server):
        yield _capture(server, dbname)


def _capture(server, dbname):  # type: ignore[no-untyped-def]
    with psycopg.connect(server.conninfo(dbname)) as conn:
        version = server_version_num(conn)
    found = variants(version)
    run_golden_workload(server, dbname, {v.slot: v.two_phase_slot for v in found})
    captures = {}
    for variant in found:
        for binary in (False, True):
            options = dataclasses.replace(variant.options, binary=binary)
            captures[(variant.name, binary)] = peek(server, dbname, variant.slot, options,
                                                    immediate_streaming=variant.immediate_streaming)
    with psycopg.connect(server.conninfo(dbname)) as conn:
        truth = {name: postgres_rows(conn, name, cols) for name, cols in TABLES.items()}
    return version, found, captures, truth


def test_every_message_type_decodes_and_replays_to_the_source_tables(golden) -> None:  # type: ignore[no-untyped-def]
    version, found, captures, truth = golden
    assert len(captures) >= (6 if version < 160000 else 10)
    for variant in found:
        for binary in (False, True):
            raws = captures[(variant.name, binary)]
            decoder = PgOutputDecoder()
            decoded = [decoder.decode(raw.data) for raw in raws]
            tags = Counter(msg.tag for msg in decoded)
            missing = variant.expected_tags - set(tags)
            assert not missing, f"{variant.name} binary={binary}: no {sorted(missing)} in {dict(tags)}"
            kinds = {chr(k) for msg in decoded if isinstance(msg, (m.Insert, m.Update))
                     for k in msg.new.kinds}
            assert ("b" in kinds) == binary and "u" in kinds | ({"u"} if variant.immediate_streaming else set())

            assembler = Assembler(spill_bytes=64 * 1024)  # small budget: the streamed transactions spill
            transactions = list(assembler.transactions(raws))
            assert not assembler.open_streamed() and not assembler.pending_prepared()
            if variant.immediate_streaming:
                continue  # these captures start mid-history on purpose; their coverage is the tags above
            reference = ReferenceTables()
            reference.apply(change_rows(transactions))
            for name, columns in TABLES.items():
                assert reference.rows(name, columns) == truth[name], f"{variant.name} binary={binary}: {name}"


def test_text_and_binary_captures_give_the_same_change_rows(golden) -> None:  # type: ignore[no-untyped-def]
    version, found, captures, truth = golden
    for variant in found:
        text_rows = [seg.rows for seg in change_rows(Assembler().transactions(captures[(variant.name, False)]))]
        binary_rows = [seg.rows for seg in change_rows(Assembler().transactions(captures[(variant.name, True)]))]
        assert text_rows == binary_rows and sum(map(len, text_rows)) > 100, variant.name


def test_columnar_change_rows_equal_the_change_by_change_ones(golden) -> None:  # type: ignore[no-untyped-def]
    version, found, captures, truth = golden
    compared = 0
    for (name, binary), raws in captures.items():
        for segment in change_rows(Assembler().transactions(raws)):
            assert segment.from_stream
            assert_columnar_matches_scalar(segment, f"{name} binary={binary} {segment.qualified_name}")
            compared += len(segment.changes)
    assert compared > 1000


def test_foreach_batch_converts_the_data_sources_text_images_to_the_rows_of_the_messages(golden) -> None:  # type: ignore[no-untyped-def]
    """The data source's text maps, read back by ``foreach_batch``, give the change rows the
    messages give, without parsing the messages again."""
    version, found, captures, truth = golden
    compared = 0
    for (name, binary), raws in captures.items():
        if binary:
            continue  # the data source's text maps need text-format values
        transactions = list(Assembler().transactions(raws))
        rows = pa.Table.from_batches(list(record_batches(transactions)), schema=SOURCE_SCHEMA)
        again, parsed = micro_batch_changes(rows)
        used: list[str] = []

        class Counted:
            def table(self, segment):  # type: ignore[no-untyped-def]
                assert parsed.table(segment) is None  # text maps are converted, never taken as they are
                return None

            def images(self, segment, wired):  # type: ignore[no-untyped-def]
                used.append(segment.qualified_name)
                return parsed.images(segment, wired)

        # Per table in stream order: the stream's Relation messages differ in their streamed xid,
        # which the data source's re-encoded definition leaves out, so segments may be cut otherwise.
        want: dict[str, list[object]] = {}
        for segment in change_rows(transactions):
            want.setdefault(segment.qualified_name, []).extend(normalised(segment.rows))
        got: dict[str, list[object]] = {}
        for segment in ChangeRowBuilder().build(again, Counted()):
            got.setdefault(segment.qualified_name, []).extend(normalised(segment.rows))
        assert got == want, name
        assert used, name
        compared += sum(map(len, got.values()))
    assert compared > 500


def test_an_empty_micro_batch_is_no_transaction() -> None:
    transactions, parsed = micro_batch_changes(SOURCE_SCHEMA.empty_table())
    assert transactions == [] and not ChangeRowBuilder().build(transactions, parsed)


def test_foreach_batch_refuses_a_text_image_that_does_not_fit_its_relation(golden) -> None:  # type: ignore[no-untyped-def]
    version, found, captures, truth = golden
    transactions = list(Assembler().transactions(captures[("v1", False)]))
    rows = pa.Table.from_batches(list(record_batches(transactions)), schema=SOURCE_SCHEMA).to_pylist()
    at = next(i for i, row in enumerate(rows) if row["op"] == "I" and row["table"] == "items")
    column = rows[at]["new"][0][0]
    for broken, message in ((rows[at]["new"][1:], f"new lacks column {column!r}"),
                            (rows[at]["new"] + [("nosuch", "1")], "new names column 'nosuch', which its relation"),
                            (rows[at]["new"] + [rows[at]["new"][0]], "new names a column twice")):
        changed = [dict(row) for row in rows]
        changed[at]["new"] = broken
        again, parsed = micro_batch_changes(pa.Table.from_pylist(changed, schema=SOURCE_SCHEMA))
        with pytest.raises(CdcApplyError, match=f"micro-batch row LSN .*: {message}"):
            for segment in ChangeRowBuilder().build(again, parsed):
                segment.to_arrow()
    # The Relation a row carries: cut short, not a Relation, or missing.
    for relation, message in ((rows[at]["_cdc_relation"][:9], r"_cdc_relation of a micro-batch row, LSN .*byte offset"),
                              (rows[at]["_cdc_change"], "micro-batch row LSN .*: _cdc_relation is not a Relation"),
                              (None, "micro-batch row LSN .*: _cdc_relation is null")):
        changed = [dict(row) for row in rows]
        changed[at]["_cdc_relation"] = relation
        with pytest.raises(CdcApplyError, match=message):
            micro_batch_changes(pa.Table.from_pylist(changed, schema=SOURCE_SCHEMA))


def test_foreach_batch_takes_typed_images_as_they_are_where_the_read_schema_fits(golden) -> None:  # type: ignore[no-untyped-def]
    """Typed rows of one table (the data source's ``table`` option) give the change rows of the
    messages: taken as they are under the read schema's Relation, converted from the messages under
    an older one (items gains a column in the capture)."""
    version, found, captures, truth = golden
    raws = captures[("v1", False)]
    assembler = Assembler()
    transactions = list(assembler.transactions(raws))
    taken: Counter[str] = Counter()
    for name in TABLES:
        table = tuple(name.split("."))
        images = images_from_relations(assembler.relations.values(), assembler.types.values(), table, "v1")  # type: ignore[arg-type]
        rows = pa.Table.from_batches(list(record_batches(transactions, images=images)), schema=typed_schema(images)[0])
        again, parsed = micro_batch_changes(rows)
        want = [row for segment in change_rows(transactions) if segment.qualified_name == name
                for row in normalised(segment.rows)]
        got = []
        for segment in ChangeRowBuilder().build(again, parsed):
            taken[str(parsed.table(segment) is not None)] += 1
            got.extend(normalised(segment.rows))
        assert got == want and want, name
    assert taken["True"] >= len(TABLES) and taken["False"] >= 1, taken


def test_protocol_features_are_decoded_faithfully(golden) -> None:  # type: ignore[no-untyped-def]
    version, found, captures, truth = golden
    by_name = {v.name: v for v in found}
    v1 = [PgOutputDecoder().decode(r.data) for r in captures[("v1", False)]]
    origin = [msg for msg in v1 if isinstance(msg, m.Origin)]
    assert [o.name for o in origin] == ["upstream"] and origin[0].origin_lsn == 0xAB
    messages = [msg for msg in v1 if isinstance(msg, m.LogicalMessage)]
    assert {(msg.transactional, msg.prefix, msg.content) for msg in messages} == {
        (True, "cdc", b"transactional"), (False, "cdc", b"not transactional")}
    truncates = [msg for msg in v1 if isinstance(msg, m.Truncate)]
    assert len(truncates) == 1 and len(truncates[0].relation_oids) == 2
    relations = [msg for msg in v1 if isinstance(msg, m.Relation) and msg.name == "items"]
    assert len(relations[-1].columns) == len(relations[0].columns) + 1  # ADD COLUMN sent a new Relation
    mixed = [msg for msg in v1 if isinstance(msg, m.Relation) and msg.name == "Mixed Case"]
    assert mixed and mixed[0].key_columns == ("Id",)
    full = [msg for msg in v1 if isinstance(msg, m.Relation) and msg.name == "fullrow"][0]
    assert full.replica_identity == "f"
    updates = [msg for msg in v1 if isinstance(msg, m.Update)]
    assert {u.old_kind for u in updates} >= {"K", "O", None}

    # Origin filtering drops the transaction that came from 'upstream'.
    kept = list(Assembler(skip_origins={"upstream"}).transactions(captures[("v1", False)]))
    every = list(Assembler().transactions(captures[("v1", False)]))
    assert len(every) - len(kept) == 1 and all(t.origin is None for t in kept)

    if "v4-parallel" in by_name:
        decoder = PgOutputDecoder()
        decoded = [decoder.decode(r.data) for r in captures[("v4-parallel", False)]]
        v4_aborts = [msg for msg in decoded if isinstance(msg, m.StreamAbort)]
        assert v4_aborts and all(a.abort_lsn is not None and a.abort_ts is not None for a in v4_aborts)
        assert any(a.aborts_whole_transaction for a in v4_aborts)
        assert any(not a.aborts_whole_transaction for a in v4_aborts)
        v2_decoder = PgOutputDecoder()
        v2_aborts = [msg for r in captures[("v2-immediate", False)]
                     for msg in [v2_decoder.decode(r.data)] if isinstance(msg, m.StreamAbort)]
        assert v2_aborts and all(a.abort_lsn is None for a in v2_aborts)


def test_spilled_transactions_with_aborted_subtransactions_match_in_memory(golden) -> None:  # type: ignore[no-untyped-def]
    version, found, captures, truth = golden
    for variant in found:
        if variant.immediate_streaming or not variant.options.streaming:
            continue
        raws = captures[(variant.name, False)]
        in_memory = list(Assembler().transactions(raws))
        spilled = list(Assembler(spill_bytes=1024).transactions(raws))
        assert not any(t.spilled_changes for t in in_memory)
        streamed = [t for t in spilled if t.kind == "streamed"]
        assert streamed and all(t.spilled_changes > 0 for t in streamed), variant.name
        # The workload's streamed transaction rolls back to a savepoint: its subtransaction's changes
        # were already on disk when the abort arrived, and must not come back from the file.
        assert any(t.spilled_changes > len(t.changes) for t in streamed), variant.name
        assert [seg.rows for seg in change_rows(spilled)] == [seg.rows for seg in change_rows(in_memory)]
