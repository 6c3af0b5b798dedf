"""The lake: where files live (``location``) and the pipeline's own state beside its targets (``state``)."""
