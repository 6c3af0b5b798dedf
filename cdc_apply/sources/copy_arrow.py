"""``COPY ... TO STDOUT`` in text format -> one Arrow binary array per column, by Arrow's CSV reader.

The same format as ``copy_text.py`` reads (one row per line, columns split by a tab, NULL written
``\\N``, a backslash escaping the rest), read by Arrow's C++ CSV parser with quoting, escaping and
empty-line skipping switched off: every raw tab or newline is a delimiter, as in the format. A
value holding a backslash is unescaped afterwards, by ``copy_text``'s own rule. The values stay
bytes in the connection's encoding (UTF-8), as ``copy_text`` gives them.

``copy_text`` gives spans over one buffer, which the change rows' machinery takes; this gives the
columns whole, which the initial copy's tasks convert directly (``snapshot/pgcopy.py``): about four
times faster for the parse and the gather together (docs/live.md, "Initial copy on Spark's executors").
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
from pyarrow import csv

from cdc_apply.errors import CdcApplyError
from cdc_apply.sources.copy_text import unescape

NEWLINE, BACKSLASH = b"\n", b"\\"


def copy_columns(data: bytes, columns: int, where: Callable[[int | None], str]) -> list[pa.Array]:
    """``data``: whole rows of a text-format COPY of ``columns`` (at least one) columns, as one
    ``large_binary`` array per column, NULL for ``\\N``. ``where(row)`` names a row (None: somewhere
    in the chunk) for an error: a row with another number of columns, or a dangling backslash."""
    if data and not data.endswith(b"\n"):
        raise CdcApplyError(f"{where(data.count(NEWLINE))}: the COPY data ends inside a row")
    if not data:
        return [pa.array([], pa.large_binary()) for _ in range(columns)]
    names = [f"c{i}" for i in range(columns)]
    try:
        table = csv.read_csv(
            pa.py_buffer(data),
            read_options=csv.ReadOptions(column_names=names, use_threads=False, block_size=max(len(data), 1 << 20) + 1),
            parse_options=csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False,
                                           newlines_in_values=False, ignore_empty_lines=False),
            convert_options=csv.ConvertOptions(column_types={n: pa.large_binary() for n in names}, null_values=["\\N"],
                                               strings_can_be_null=True, check_utf8=False))
    except pa.ArrowInvalid as exc:
        raise CdcApplyError(f"{where(None)}: the COPY rows do not have {columns} columns each: {exc}") from None
    values = [table.column(i).combine_chunks() for i in range(columns)]
    if data.count(BACKSLASH) == sum(column.null_count for column in values):
        return values  # every backslash is a NULL's: no value holds an escape
    return [_unescaped(column, where) for column in values]


def _unescaped(values: pa.Array, where: Callable[[int | None], str]) -> pa.Array:
    """The column with each value that holds a backslash unescaped (``\\N`` is NULL already)."""
    escaped = pc.fill_null(pc.match_substring(values, "\\"), False)
    if not pc.any(escaped).as_py():
        return values
    rows = pc.indices_nonzero(escaped).to_pylist()
    fixed = values.to_pylist()
    for row in rows:
        fixed[row] = unescape(fixed[row], lambda row=row: where(row))  # type: ignore[misc]
    return pa.array(fixed, pa.large_binary())
