"""The change log (docs/change-log-table.md): what the pipeline writes to it and reads from it
(``log.py``: ``ChangeLog``), its files (``log_files.py``), the targets brought up from it
(``applier.py``), and a large transaction's collapse on Spark's executors (``log_collapse.py``).
``cdc-apply follow-changelog``, a runner, is ``cdc_apply/follow_changelog.py``.

``from cdc_apply.changelog import ChangeLog`` (the path before this package) keeps working; the
names load when first asked for, so a Spark worker that imports ``log_collapse`` loads only that.
"""

from typing import Any

__all__ = ["ChangeLog", "ChangeLogError", "RecordedCopy", "changelog_target", "enabled_changelog"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cdc_apply.changelog import log

        return getattr(log, name)
    raise AttributeError(name)
