"""`cdc-apply decode`: capture files -> one JSON object per message, or per change row."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TextIO

from cdc_apply.transactions import Transaction
from cdc_apply.changerows.segments import ChangeRowBuilder
from cdc_apply.errors import DecodeError
from cdc_apply.lsn import format_lsn
from cdc_apply.pgoutput.decoder import PgOutputDecoder
from cdc_apply.render import change_row_json, message_json
from cdc_apply.replication import BatchCut, ReplicationCore
from cdc_apply.sources.capture import read_captures


CHANGES_PER_BATCH = 10_000


def _dump(obj: object, out: TextIO) -> None:
    out.write(json.dumps(obj, ensure_ascii=False, default=str) + "\n")


class _JsonRowsSink:
    """Each batch's change rows as JSON lines, per table within the batch."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.builder = ChangeRowBuilder()

    def write_batch(self, batch: list[Transaction]) -> None:
        for segment in self.builder.build(batch):
            for row in segment.rows:
                _dump(change_row_json(segment, row), self.out)


def run_decode(paths: Sequence[str], *, changes: bool, out: TextIO) -> int:
    if changes:
        # A batch at a time, so memory stays bounded.
        with ReplicationCore(_JsonRowsSink(out), cut=BatchCut(CHANGES_PER_BATCH)) as core:
            for _ in core.write_all(read_captures(paths), "the capture"):
                pass
        return 0
    decoder = PgOutputDecoder()
    for raw in read_captures(paths):
        try:
            message = decoder.decode(raw.data)
        except DecodeError as exc:
            raise exc.located(lsn=format_lsn(raw.lsn), source=raw.source) from None
        _dump(message_json(message, raw.lsn), out)
    return 0
