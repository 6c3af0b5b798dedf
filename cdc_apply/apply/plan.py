"""The plan of one table's batch: what its target holds, how it may be written, and by which key.

``TablePlan`` is decided before any row is collapsed (``BatchApplier._plan``); the rules here say
which key a target has under each Relation (docs/apply.md, "Keys") and when new rows may be
appended instead of merged. Nothing here touches Spark or Delta.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cdc_apply.apply.collapse import Collapsed, Collapser
from cdc_apply.apply.columnar import CollapsedColumns
from cdc_apply.apply.options import TableOptions
from cdc_apply.apply.target_state import TargetState
from cdc_apply.apply.targets import SourceState, Target
from cdc_apply.changerows.codec import PortableCodec
from cdc_apply.errors import CdcApplyError
from cdc_apply.pgoutput import messages as m

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)


class TableConfigError(CdcApplyError):
    """A table the apply cannot serve as configured (no usable key, unknown key column)."""


@dataclass
class TableResult:
    table: str
    location: str
    ops: Counter[str] = field(default_factory=Counter)
    keys_written: int = 0  # not counted (0) when Spark collapsed the batch
    first_lsn: int | None = None
    last_lsn: int | None = None
    schema_changes: list[str] = field(default_factory=list)
    # source column -> the target column it now feeds, where they differ (a lenient retype's
    # ``d__int``, a case clash): readers find a column's current values there
    side_columns: dict[str, str] = field(default_factory=dict)
    text_columns: list[str] = field(default_factory=list)  # kept as PostgreSQL's text by evolve
    skipped: bool = False  # already applied (exactly once)
    write: str = ""  # how the data was committed: snapshot, append or merge
    columnar: bool = False  # collapsed as Arrow columns (apply/columnar.py), not row by row
    pieces: int = 0  # a spilled transaction appended a piece at a time: how many (0: written whole)
    seconds: float = 0.0


@dataclass(frozen=True)
class Versioning:
    """How a batch's Delta commits are made idempotent (see the module invariants)."""

    version: int  # the batch's last commit LSN: rows at or below a target's version are dropped
    copy_progress: Mapping[str, object] | None = None  # a snapshot chunk: recorded in its own commit
    stream_batch: tuple[str, int] | None = None  # (query id, batch id) of a micro-batch: recorded too


@dataclass
class BatchResult:
    transactions: int
    first_lsn: int | None
    last_lsn: int | None
    tables: list[TableResult]
    seconds: float

    @property
    def changes(self) -> int:
        return sum(sum(t.ops.values()) for t in self.tables if not t.skipped)


@dataclass
class TablePlan:
    """One table in one batch, as decided before any row is collapsed."""

    oid: int
    relation: m.Relation  # the first segment's
    options: TableOptions
    target: Target
    registered: bool
    known: TargetState  # the target's Delta state at the batch's start
    app_id: str
    versioning: Versioning
    snapshot: bool
    lsn_done: int | None  # the pipeline's LSN version: rows at or below it are in the target already
    appendable: bool  # new rows may be appended (see ``BatchApplier._plan``)
    done: bool  # the target holds this batch already (exactly once)

    @property
    def qualified(self) -> str:
        return f"{self.relation.namespace}.{self.relation.name}"


@dataclass
class CollapsedBatch:
    """One table's batch collapsed: the writer's input."""

    state: SourceState  # the source state after the batch's schema changes
    collapsed: Collapsed  # the states per key; for a columnar collapse only counts and LSNs
    collapser: Collapser | None  # None for a columnar collapse
    columnar: CollapsedColumns | None
    new_rows_only: bool
    appendable: bool
    # Collapsed by Spark (``ExternalCollapse``): the MERGE source as a DataFrame, ``collapsed`` only
    # its counts and LSNs; no row of it on the driver.
    frame: DataFrame | None = None


# Given the table's codec (to build in Spark's tasks), column map (source -> target), key, target
# types and the LSN its target holds: the MERGE source as a Spark DataFrame collapsed off the driver
# (``changelog/log_collapse.py``).
ExternalCollapse = Callable[[PortableCodec, dict[str, "str | None"], tuple[str, ...], dict[str, str], "int | None"],
                            "DataFrame"]


class MissingValue(Protocol):
    """What the backfill needs to know of a column added with a default (``sources.catalog`` gives it)."""

    known: bool  # the catalog still holds the value (not a volatile default, no rewrite since)
    text: str | None  # its text form; None for NULL
    has_default: bool
    generated: bool  # a stored generated column, published from now on


MissingValueLookup = Callable[[int, str], MissingValue]  # (relation OID, column) -> the value


def later_keys(state: SourceState, relation: m.Relation, options: TableOptions) -> tuple[tuple[str, ...], bool]:
    """The target's key under this Relation, and whether it is the whole row (docs/apply.md, "Keys").

    The rows stay the same rows whatever the replica identity, so the target is re-keyed in
    place, never copied again: a unique key stays the key under FULL (the old row carries it);
    a primary key or USING INDEX that the Relation flags becomes the key (the rows are unique on
    it, or PostgreSQL would have refused it), also for an insert-only table (``ADD PRIMARY KEY``);
    a table without a key that turns FULL is keyed by the whole row, which grows with its columns."""
    if options.keys:
        return state.keys, state.whole_row
    targets = state.column_map()
    identity = tuple(targets.get(k) for k in relation.key_columns)
    complete = bool(identity) and None not in identity
    if relation.replica_identity == "f":
        if state.keys and not state.whole_row:
            return state.keys, False
        if state.whole_row and multiset(state, options):
            return tuple(t for t in identity if t is not None), True
        if not state.keys and complete:
            return identity, True  # type: ignore[return-value]
        return state.keys, state.whole_row
    if relation.replica_identity in ("d", "i") and complete and identity != state.keys:
        log.info("%s.%s: now keyed by %s (replica identity %s): applied by that key from here on",
                 relation.namespace, relation.name, list(identity),
                 m.REPLICA_IDENTITY_NAMES.get(relation.replica_identity, relation.replica_identity))
        return identity, False  # type: ignore[return-value]
    return state.keys, state.whole_row


def initial_keys(relation: m.Relation, options: TableOptions, columns: set[str]) -> tuple[str, ...]:
    qualified = f"{relation.namespace}.{relation.name}"
    if options.keys:
        missing = [k for k in options.keys if k not in columns]
        if missing:
            raise TableConfigError(f"{qualified}: configured keys {missing} are not columns of the table "
                                   f"(columns: {sorted(columns)})")
        return tuple(options.keys)
    keys = tuple(k for k in relation.key_columns if k in columns)
    if relation.replica_identity == "n":
        return ()  # REPLICA IDENTITY NOTHING: the source allows inserts only
    if not keys and relation.replica_identity == "d":
        # PostgreSQL refuses UPDATE and DELETE on a published table without a replica identity
        # key, so only inserts and truncates can arrive: the table is applied insert-only.
        log.warning("%s: no primary key (replica identity default): applied insert-only, like REPLICA "
                    "IDENTITY NOTHING; a key added later switches it to keyed apply", qualified)
        return ()
    if not keys:
        raise TableConfigError(
            f"{qualified}: no usable key (replica identity "
            f"{m.REPLICA_IDENTITY_NAMES.get(relation.replica_identity, relation.replica_identity)} "
            "without key columns); set tables.<name>.keys in the config or give the table a primary key")
    return keys


def multiset(state: SourceState, options: TableOptions) -> bool:
    """Keyed by the whole row (REPLICA IDENTITY FULL without a unique key): identical rows may exist, each
    kept (hard deletes, SCD type 1; soft deletes and history keep one row per distinct value, docs/apply.md)."""
    return state.whole_row and not options.keys and options.delete_mode == "hard" and options.scd_type == 1


def appends_new_rows(plan: TablePlan, state: SourceState) -> bool:
    """New rows of the batch may be appended to the target as ``state`` keys it (see ``BatchApplier._plan``)."""
    return plan.appendable and unique_key(plan.relation, state.column_map(), state.keys, plan.options)


def unique_key(relation: m.Relation, column_map: dict[str, str | None], keys: tuple[str, ...],
                options: TableOptions) -> bool:
    """The target's keys are the source's primary key or replica identity index (so unique), and a
    delete removes the row (soft deletes keep keys that PostgreSQL may insert again)."""
    return (relation.replica_identity in ("d", "i") and not options.keys and options.delete_mode != "soft"
            and bool(keys) and tuple(column_map.get(k, k) for k in relation.key_columns) == keys)
