"""A MERGE's key filter: a condition on the target's key columns alone, built from the batch's keys,
so a MERGE reads the rows (and, through Delta's data skipping, the files) its keys can be in, not
every row of the table (docs/apply.md, "What a MERGE reads").

The MERGE matches ``t.k <=> s.k``; the filter adds, per key column, ``t.k IN (<the batch's values>)``
(up to ``IN_LIST_MAX`` distinct values) or ``t.k BETWEEN <least> AND <greatest>``, with
``OR t.k IS NULL`` when a key value is NULL. Every target row the MERGE matches satisfies it, so it
changes what is read, never what is written. Delta applies a condition on the target alone before
the join that finds the touched files: rows outside it are not shuffled, and files whose min/max
statistics exclude it are not read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from cdc_apply.apply.targets import quote, sql_string

IN_LIST_MAX = 1_000
# Key types whose values the filter writes as SQL literals, and whose order Python and Spark share.
_INTEGERS = ("tinyint", "smallint", "int", "bigint")


def _literal(value: Any, spark_type: str) -> str | None:
    if spark_type in _INTEGERS and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if spark_type == "string" and isinstance(value, str):
        return sql_string(value)
    if spark_type.startswith("decimal(") and isinstance(value, (Decimal, int)):
        return f"CAST({sql_string(str(value))} AS {spark_type})"
    return None


def key_filter(keys: Sequence[str], data_types: Mapping[str, str], values: Mapping[str, Iterable[Any]]) -> str | None:
    """The filter on the target (alias ``t``) for a batch whose key columns hold ``values``; None when
    no key column's values can be written as literals (floats, dates, binary: the MERGE reads all)."""
    terms = []
    for key in keys:
        spark_type = data_types.get(key, "")
        column = f"t.{quote(key)}"
        distinct = set(values.get(key, ()))
        nulls = None in distinct
        distinct.discard(None)
        literals = {value: _literal(value, spark_type) for value in distinct}
        if not literals or None in literals.values():
            continue
        ordered = sorted(literals)
        if len(ordered) <= IN_LIST_MAX:
            term = f"{column} IN ({', '.join(literals[value] for value in ordered)})"  # type: ignore[misc]
        else:
            term = f"{column} BETWEEN {literals[ordered[0]]} AND {literals[ordered[-1]]}"
        terms.append(f"({term} OR {column} IS NULL)" if nulls else term)
    return " AND ".join(terms) or None
