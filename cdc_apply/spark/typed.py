"""Typed images for one table: ``option("table", "schema.name")``.

Without it the source serves every table under one schema, so its images are text maps. Naming
a table gives that table's change rows with ``key``/``old``/``new`` as structs of its column
types, converted by the same converters as ``cdc-apply run`` (``changerows.columns.change_table``).
The read schema is the table's Relation when the read starts: the catalog (as pgoutput describes
it: the publication's column list, no generated columns) for a slot, the last Relation message
in the files for captures.

Invariants (tests/test_datasource.py):
- A column of the read schema that a change's Relation lacks (added later, dropped earlier) is
  null in that change's images.
- A change whose Relation has a column the read schema lacks, or a type that does not cast to it
  without loss, fails the read naming the table, the column and the LSN. Nothing is dropped
  silently: the table changed after the schema was read, and a new read (or a restart of the
  query) reads the new schema.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import psycopg
import pyarrow as pa

from cdc_apply.arrow_nulls import null_array
from cdc_apply.changerows.segments import RelationCodec, TableChanges
from cdc_apply.config import ConfigError
from cdc_apply.errors import CdcApplyError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput import messages as m
from cdc_apply.pgtypes import TypeCache
from cdc_apply.sources.catalog import type_messages
from cdc_apply.sources.exported_snapshot import published_tables

IMAGES = ("key", "old", "new")


def parse_table_name(text: str) -> tuple[str, str]:
    """``schema.table`` or ``table`` (schema ``public``); names as PostgreSQL stores them."""
    schema, dot, table = text.rpartition(".")
    if not table or (dot and not schema):
        raise ConfigError(f"pgoutput option table: must be 'schema.table' or 'table' (got {text!r})")
    return (schema or "public", table)


def spark_arrow(arrow: pa.DataType) -> pa.DataType:
    """The Arrow type Spark expects for a Spark type: nullable fields, list items named ``element``."""
    if pa.types.is_list(arrow):
        return pa.list_(pa.field("element", spark_arrow(arrow.value_type)))
    if pa.types.is_struct(arrow):
        return pa.struct([pa.field(f.name, spark_arrow(f.type)) for f in arrow])
    return arrow


def quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


@lru_cache(maxsize=64)
def _codec(relation: m.Relation, custom_types: tuple[tuple[int, str, str, str | None], ...]) -> RelationCodec:
    types = TypeCache()
    for oid, namespace, name, facts in custom_types:
        types.add(oid, namespace, name, facts)
    return RelationCodec.build(relation, types)


@dataclass(frozen=True)
class TableImages:
    """The read schema of one table's images, and how a segment's images are made to fit it.

    Plain messages only: Spark pickles it to the Python workers, and the codecs' converters do not pickle."""

    relation: m.Relation
    # (oid, namespace, name, catalog facts) as Type messages name them (the facts attached by the assembler)
    custom_types: tuple[tuple[int, str, str, str | None], ...]

    @property
    def codec(self) -> RelationCodec:
        return _codec(self.relation, self.custom_types)

    @property
    def qualified_name(self) -> str:
        return f"{self.codec.relation.namespace}.{self.codec.relation.name}"

    def holds(self, relation: m.Relation) -> bool:
        return (relation.namespace, relation.name) == (self.codec.relation.namespace, self.codec.relation.name)

    def _indexes(self, image: str) -> list[int]:
        return self.codec.key_indexes if image == "key" else list(range(len(self.codec.columns)))

    def arrow_type(self, image: str) -> pa.DataType:
        return spark_arrow(self.codec.image_type(self._indexes(image)))

    def spark_ddl(self, image: str) -> str:
        columns = self.codec.columns
        fields = [f"{quoted(columns[i].name)}:{columns[i].pg_type.spark_type(columns[i].typmod)}"
                  for i in self._indexes(image)]
        return f"struct<{','.join(fields)}>"

    def conform(self, images: dict[str, pa.Array], segment: TableChanges) -> dict[str, pa.Array]:
        """``images`` (typed as ``segment``'s Relation) as the read schema types them."""
        return {name: self._conform(name, images[name], segment) for name in IMAGES}

    def _conform(self, image: str, array: pa.Array, segment: TableChanges) -> pa.Array:
        wanted = self.arrow_type(image)
        struct = array.cast(spark_arrow(array.type)) if isinstance(array, pa.StructArray) else array
        assert isinstance(struct, pa.StructArray)
        have = {field.name: i for i, field in enumerate(struct.type)}
        extra = sorted(set(have) - {field.name for field in wanted})
        if extra:
            raise self._changed(segment, f"column {extra[0]!r} is not in the read schema")
        children = []
        for field in wanted:
            if field.name not in have:
                children.append(null_array(len(struct), field.type))
                continue
            child = struct.field(have[field.name])
            try:
                children.append(child.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise self._changed(segment, f"column {field.name!r} is now {child.type}, the read schema has "
                                             f"{field.type} ({exc})") from None
        mask = pa.array(~np.asarray(struct.is_valid()))
        return pa.StructArray.from_arrays(children, fields=list(wanted), mask=mask)

    def _changed(self, segment: TableChanges, what: str) -> CdcApplyError:
        lsn = format_lsn(segment.transactions[0].commit_lsn) if segment.transactions else "?"
        return CdcApplyError(f"pgoutput option table: {self.qualified_name} changed at LSN {lsn}: {what}; "
                             "read again (or restart the query) to read the new schema")


def images_from_catalog(conn: psycopg.Connection, publications: Sequence[str], table: tuple[str, str]) -> TableImages:
    """The table as the publications publish it now."""
    for published in published_tables(conn, publications):
        relation = published.relation
        if (relation.namespace, relation.name) == table:
            # the Type messages the stream sends before this Relation
            return TableImages(relation, tuple(type_messages(conn, (c.type_oid for c in relation.columns))))
    raise ConfigError(f"pgoutput option table: {'.'.join(table)} is not published by publication(s) "
                      f"{', '.join(map(repr, publications))}")


def images_from_relations(relations: Iterable[m.Relation], types: Iterable[m.Type], table: tuple[str, str],
                          where: str) -> TableImages:
    """The table's last Relation message among ``relations`` (in stream order)."""
    last = None
    for relation in relations:
        if (relation.namespace, relation.name) == table:
            last = relation
    if last is None:
        raise ConfigError(f"pgoutput option table: no Relation message for {'.'.join(table)} in {where}")
    return TableImages(last, tuple((t.oid, t.namespace, t.name, t.facts) for t in types))
