"""The pipeline's own state, beside its targets on the same storage (docs/operations.md, "The
pipeline's state").

Under ``<warehouse>/_cdc_apply/``, namespaced by pipeline so that pipelines from several source
databases share one warehouse:
- ``targets/<pipeline>.json``: relation OID -> its target (``TargetRegistry``);
- ``changelog_applied/<pipeline>.json``: the commit LSN every target holds the change log to
  (``AppliedPosition``);
- ``resync/<pipeline>/<oid>``: a re-copy asked for and not finished (``ResyncMarks``).
- ``clean_stop/<pipeline>.json``: on Spark Connect, what a run that stopped cleanly left fenced
  (``apply/fence.clean_stops``).

Each is a small object with one writer, its pipeline, written whole: an object store's PUT is
atomic, and a local file is written beside and renamed over. So the state needs no Spark (``status``
reads it, and a Spark Connect client writes it) and no Delta table of its own, whose every commit
would cost a log entry and, on S3, the same one-writer assumption. A pipeline's name becomes one
path component by ``path_component``.

Ownership: a pipeline that would register a target another pipeline's registry holds is refused
(``TargetOwnedError``). The check reads the other registries when a target is first registered;
two pipelines registering the same new target at the same instant are not caught.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

from cdc_apply.errors import CdcApplyError
from cdc_apply.lake.location import Location, Storage, StorageError, path_component
from cdc_apply.lsn import format_lsn, parse_lsn

STATE_DIRECTORY = "_cdc_apply"


class TargetOwnedError(CdcApplyError):
    """A target another pipeline writes."""


@dataclass(frozen=True)
class PipelineState:
    warehouse: Location
    pipeline: str
    storage: Storage = field(default_factory=Storage)

    @classmethod
    def at(cls, warehouse: str | Location, pipeline: str, storage: Storage | None = None) -> PipelineState:
        return cls(Location.parse(warehouse), pipeline, storage or Storage())

    def location(self, *names: str) -> Location:
        return self.warehouse.child(STATE_DIRECTORY, *names)

    @property
    def component(self) -> str:
        """The pipeline's name as one path component."""
        return path_component(self.pipeline)

    def read_json(self, location: Location) -> Any | None:
        text = self.storage.read_text(location)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise StorageError(f"{location}: not the JSON cdc_apply wrote ({exc}); restore it or remove it") from None

    def write_json(self, location: Location, data: object) -> None:
        self.storage.write_text(location, json.dumps(data, indent=1, sort_keys=True))


class TargetRegistry:
    """relation OID -> target location, kept in ``<warehouse>/_cdc_apply/targets/<pipeline>.json``.

    A warehouse written before the registry was namespaced holds ``_cdc_apply/targets.json``: read
    while the pipeline has no registry of its own, which its first write then makes."""

    def __init__(self, state: PipelineState) -> None:
        self.state = state
        self.location = state.location("targets", f"{state.component}.json")
        self._lock = threading.Lock()
        entries = state.read_json(self.location)
        if entries is None:
            entries = state.read_json(state.location("targets.json")) or {}
        self._entries: dict[str, dict[str, Any]] = entries

    def get(self, relation_oid: int) -> dict[str, Any] | None:
        return self._entries.get(str(relation_oid))

    def add(self, relation_oid: int, location: str, by_name: bool, schema: str, table: str) -> None:
        with self._lock:  # tables may be applied by several threads
            if not any(entry["location"] == location for entry in self._entries.values()):
                self._refuse_if_owned(location, schema, table)
            self._entries[str(relation_oid)] = {"location": location, "by_name": by_name,
                                                "schema": schema, "table": table}
            self.state.write_json(self.location, self._entries)

    def entries(self) -> dict[int, dict[str, Any]]:
        return {int(oid): entry for oid, entry in self._entries.items()}

    def _refuse_if_owned(self, location: str, schema: str, table: str) -> None:
        directory = self.state.location("targets")
        for name in self.state.storage.names(directory):
            if name == self.location.name or not name.endswith(".json"):
                continue
            other = self.state.read_json(directory.child(name)) or {}
            if any(entry.get("location") == location for entry in other.values()):
                raise TargetOwnedError(
                    f"the target of {schema}.{table} would be {location}, which pipeline {name[:-5]!r} writes "
                    f"(registered in {directory.child(name)}); two pipelines cannot write one target: give pipeline "
                    f"{self.state.pipeline!r} another target.warehouse or target.path_template (or, if "
                    f"{name[:-5]!r} is retired, remove that registry)")


class AppliedPosition:
    """The commit LSN up to which every target of a warehouse holds a pipeline's change log, in
    ``_cdc_apply/changelog_applied/<pipeline>.json`` (before: one ``changelog_applied.json`` for all)."""

    def __init__(self, state: PipelineState) -> None:
        self.state = state
        self.location = state.location("changelog_applied", f"{state.component}.json")

    def read(self) -> int | None:
        entry = self.state.read_json(self.location)
        if entry is None:
            entry = self.state.read_json(self.state.location("changelog_applied.json")) or {}
        text = entry.get(self.state.pipeline)
        return parse_lsn(text) if text else None

    def write(self, lsn: int) -> None:
        self.state.write_json(self.location, {self.state.pipeline: format_lsn(lsn)})


class ResyncMarks:
    """Tables whose re-copy was asked for and has not finished: one empty object per relation OID."""

    def __init__(self, state: PipelineState) -> None:
        self.state = state
        self.directory = state.location("resync", state.component)

    def add(self, oid: int) -> None:
        self.state.storage.write_text(self.directory.child(str(oid)), "")

    def pending(self, oid: int) -> bool:
        return self.state.storage.read_text(self.directory.child(str(oid))) is not None

    def remove(self, oid: int) -> None:
        self.state.storage.delete(self.directory.child(str(oid)))
