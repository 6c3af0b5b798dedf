"""A deliberately simple, independent applier used as a test oracle (not product code).

It replays change rows in order into Python dicts keyed by the key image, following DESIGN.md's
semantics (key changes, unchanged TOAST, truncate), and renders values as PostgreSQL text.
"""

from __future__ import annotations

from typing import Any

from cdc_apply.changerows.segments import TableChanges


def _as_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class ReferenceTables:
    def __init__(self) -> None:
        self.tables: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}

    def apply(self, segments: list[TableChanges]) -> None:
        rows = [(row["commit_lsn"], row["seq"], seg, row) for seg in segments for row in seg.rows]
        rows.sort(key=lambda item: (item[0], item[1]))
        for _, _, segment, row in rows:
            self._apply_row(segment, row)

    def _apply_row(self, segment: TableChanges, row: dict[str, Any]) -> None:
        table = self.tables.setdefault(segment.qualified_name, {})
        json_of = {c.name: c.pg_type.to_json for c in segment.codec.columns}

        def rendered(image: dict[str, Any]) -> dict[str, Any]:
            return {k: _as_text(None if v is None else json_of[k](v)) for k, v in image.items()}

        op = row["op"]
        if op == "T":
            table.clear()
            return
        key_names = [segment.codec.columns[i].name for i in segment.codec.key_indexes]
        old_key = tuple(rendered(row["key"])[k] for k in key_names) if row["key"] else None
        if op == "D":
            del table[old_key]
            return
        new_image = rendered(row["new"])
        new_key = tuple(new_image[k] for k in key_names)
        if op == "U":
            previous = table.pop(old_key, None) if old_key is not None else table.pop(new_key, None)
            for name in row["unchanged"]:
                assert previous is not None, f"unchanged TOAST column {name} with no prior row"
                new_image[name] = previous[name]
        table[new_key] = new_image

    def rows(self, qualified: str, columns: list[str]) -> list[tuple[str | None, ...]]:
        return sorted((tuple(r.get(c) for c in columns) for r in self.tables.get(qualified, {}).values()),
                      key=repr)


def postgres_rows(conn: Any, qualified: str, columns: list[str]) -> list[tuple[str | None, ...]]:
    """``qualified`` is schema.table unquoted, as change rows name it."""
    schema, _, table = qualified.partition(".")
    select = ", ".join(f'"{c}"::text' for c in columns)
    rows = conn.execute(f'SELECT {select} FROM "{schema}"."{table}"').fetchall()
    return sorted((tuple(r) for r in rows), key=repr)
