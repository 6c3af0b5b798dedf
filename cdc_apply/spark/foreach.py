"""``writeStream.foreachBatch(foreach_batch(config))``: a micro-batch of ``pgoutput`` change rows -> Delta.

The micro-batch is turned back into committed transactions (``_cdc_relation`` carries the Relation
message in force, decoded once per definition) and applied by the same ``BatchApplier`` as
``cdc-apply run``: one MERGE per table, schema evolution, TOAST retention, truncates. The images
are the data source's (``spark/rows.py``, ``MicroBatchRows``): typed images are taken as they are,
text maps are converted from the values it parsed; ``_cdc_change`` is parsed again only where the
read schema types a column otherwise than the target, and kept for the row-by-row fallback and
error messages.

Invariant: every Delta commit of a micro-batch carries ``txnAppId = <pipeline>/<relation oid>``
and ``txnVersion = <the batch's last commit LSN>``, as ``cdc-apply run``'s do (docs/streaming.md,
"foreach_batch(config)"): Spark re-running a batch, a batch cut short between two tables'
commits, and a new checkpoint over applied changes all drop the rows at or below each table's
version, so nothing is applied twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_apply.apply.batch import BatchApplier
from cdc_apply.apply.options import apply_options
from cdc_apply.transactions import Change, Transaction
from cdc_apply.config import Config, load_config
from cdc_apply.errors import CdcApplyError, DecodeError
from cdc_apply.lsn import PG_EPOCH_OFFSET_US, format_lsn
from cdc_apply.metrics import PipelineMetrics
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgoutput.decoder import decode_message
from cdc_apply.sink import DeltaSink, RunSummary
from cdc_apply.sources.catalog import SourceCatalog
from cdc_apply.spark.rows import MicroBatchRows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

APPLY_COLUMNS = ("commit_lsn", "end_lsn", "commit_ts", "xid", "origin", "seq", "op", "truncate_options",
                 "_cdc_relation", "_cdc_change")
# Frames read from capture files have no source to ask (``foreach_batch(live_source=False)``).
OFFLINE_HINT = ("for frames read from capture files use foreach_batch(config, live_source=False), which skips the "
                "backfill as replay does")
ROW_COLUMNS = ("relation_oid", "schema", "table", "key", "old", "new", "unchanged")  # the rows as parsed


def foreach_batch(config: Config | str | Path, *, live_source: bool = True,
                  metrics: PipelineMetrics | None = None,
                  sink: DeltaSink | None = None) -> Callable[[DataFrame, int], None]:
    """A ``foreachBatch`` function applying ``format("pgoutput")`` micro-batches per ``config``.

    ``live_source=False`` for frames read from capture files: there is no server to ask for the value
    ``ADD COLUMN ... DEFAULT`` gave earlier rows, so that backfill is skipped, as ``replay`` does.
    ``metrics`` is told every micro-batch (``cdc-apply stream`` serves them). ``sink``: where the
    micro-batches go (``cdc-apply stream`` passes one that appends to the change log first,
    ``parts.run_parts``); by default the targets only, through a ``BatchApplier`` made
    at the first micro-batch, in its session."""
    settings = config if isinstance(config, Config) else load_config(config)
    # One sink for the function's life: its applier keeps its table thread pool.
    sinks: list[DeltaSink] = [sink] if sink is not None else []
    summary = sink.summary if sink is not None else RunSummary(metrics=metrics)

    def apply_micro_batch(frame: DataFrame, batch_id: int) -> None:
        spark = frame.sparkSession
        query_id = streaming_query_id(spark)
        if not sinks:
            missing_value = SourceCatalog.of(settings.source, OFFLINE_HINT).missing_value if live_source else None
            sinks.append(DeltaSink(BatchApplier(spark, apply_options(settings), missing_value=missing_value), summary))
        transactions, parsed = micro_batch_changes(frame.select(*APPLY_COLUMNS, *ROW_COLUMNS).toArrow())
        changes = sum(len(t.changes) for t in transactions)
        if metrics is not None:
            metrics.received_changes(changes)
        result = sinks[0].write_batch(transactions, stream_batch=(query_id, batch_id), parsed=parsed)
        if result is None:  # the targets follow from the change log
            log.info("batch %d: %d transactions, %d changes in the change log", batch_id, len(transactions), changes)
            return
        applied = [t for t in result.tables if not t.skipped]
        log.info("batch %d: %d transactions, %d changes to %d tables (%d already held it)%s", batch_id,
                 result.transactions, result.changes, len(applied), len(result.tables) - len(applied),
                 f", LSN {format_lsn(result.first_lsn)}..{format_lsn(result.last_lsn)}" if result.first_lsn else "")

    apply_micro_batch.summary = summary  # type: ignore[attr-defined]  # batches and commit->Delta lag
    return apply_micro_batch


def streaming_query_id(spark: SparkSession) -> str:
    """The running query's id: Spark sets it as a local property for the batch it runs. A Spark
    Connect foreachBatch worker has no SparkContext: there it is the session's one active query."""
    from cdc_apply.apply.session_kind import is_connect

    if is_connect(spark):
        active = [query.id for query in spark.streams.active]
        return active[0] if len(active) == 1 else f"connect-session-{spark.session_id}"
    query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
    if not query_id:
        raise CdcApplyError("foreach_batch: no streaming query id in this Spark context; "
                            "use the function with writeStream.foreachBatch(...)")
    return query_id


def micro_batch_changes(table: pa.Table) -> tuple[list[Transaction], MicroBatchRows]:
    """Change rows of ``format("pgoutput")`` -> committed transactions in commit order, and the rows
    as parsed, for the apply to take without parsing the messages again. Read a column at a time:
    each distinct ``_cdc_relation`` is decoded once, each transaction's fields read once."""
    ordered = table.sort_by([("commit_lsn", "ascending"), ("xid", "ascending"), ("seq", "ascending")])
    ordered = ordered.set_column(ordered.schema.get_field_index("commit_ts"), "commit_ts",
                                 ordered["commit_ts"].cast(pa.int64()))  # microseconds since 1970
    count = ordered.num_rows
    if count == 0:  # Spark runs a batch for an offset that moved over unpublished WAL only
        return [], MicroBatchRows(ordered, {})
    commit_lsns = ordered["commit_lsn"].to_numpy()
    xids = ordered["xid"].to_numpy()
    firsts = np.flatnonzero(np.concatenate(([True], (commit_lsns[1:] != commit_lsns[:-1]) | (xids[1:] != xids[:-1]))))
    definitions = pc.dictionary_encode(ordered["_cdc_relation"].combine_chunks())
    if definitions.null_count:
        lsn = int(commit_lsns[int(np.argmax(np.asarray(definitions.is_null(), bool)))])
        raise CdcApplyError(f"micro-batch row LSN {format_lsn(lsn)}: _cdc_relation is null")
    relation_at = definitions.indices.to_numpy()
    relations = [relation_of(raw, int(commit_lsns[int(np.argmax(relation_at == code))]))
                 for code, raw in enumerate(definitions.dictionary.to_pylist())]
    relation_by_row = [relations[code] for code in relation_at.tolist()]
    seqs, ops, wires = (ordered[name].to_pylist() for name in ("seq", "op", "_cdc_change"))
    truncate_options = ordered["truncate_options"].fill_null(0).to_pylist()
    heads = ordered.take(pa.array(firsts)).select(["xid", "commit_lsn", "end_lsn", "commit_ts", "origin"]).to_pylist()
    transactions: list[Transaction] = []
    for head, first, end in zip(heads, firsts.tolist(), [*firsts[1:].tolist(), count]):
        lsn = head["commit_lsn"]
        source = f"micro-batch row LSN {format_lsn(lsn)}"
        changes = [Change(seqs[i], ops[i], relation_by_row[i], truncate_options=truncate_options[i], lsn=lsn,
                          wire=wires[i], source=source) for i in range(first, end)]
        transactions.append(Transaction(head["xid"], lsn, head["end_lsn"], head["commit_ts"] - PG_EPOCH_OFFSET_US,
                                        changes, origin=head["origin"]))
    row_of = {id(change): row for row, change in enumerate(c for t in transactions for c in t.changes)}
    return transactions, MicroBatchRows(ordered, row_of)


def relation_of(raw: bytes, lsn: int) -> m.Relation:
    """A row's ``_cdc_relation`` decoded (``lsn``: the row's, for the error)."""
    try:
        decoded = decode_message(raw)
    except DecodeError as exc:
        raise exc.located(lsn=format_lsn(lsn), source="_cdc_relation of a micro-batch row") from None
    if not isinstance(decoded, m.Relation):
        raise CdcApplyError(f"micro-batch row LSN {format_lsn(lsn)}: _cdc_relation is not a Relation message")
    return decoded
