"""The initial copy (docs/live.md, "The initial copy"): the copier of a pipeline's tables
(``copier.py``: ``Snapshotter``) and the copy's Spark tasks (``pgcopy.py``, ``format("pgcopy")``);
its source side (the exported snapshot, the page ranges, COPY) is in ``cdc_apply/sources``.

``from cdc_apply.snapshot import Snapshotter`` (the path before this package) keeps working; the
names load when first asked for, so a Spark worker that imports ``pgcopy`` loads only that.
"""

from typing import Any

__all__ = ["Snapshotter", "TableSnapshot"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from cdc_apply.snapshot import copier

        return getattr(copier, name)
    raise AttributeError(name)
