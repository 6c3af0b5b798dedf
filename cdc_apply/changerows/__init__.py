"""Change rows: what the assembler's transactions become, per table segment (docs/architecture.md,
"Change rows"). ``segments`` cuts transactions into per-table segments (``TableChanges``,
``ChangeRowBuilder``); ``codec`` holds the column codecs and the change-by-change reference
conversion; ``columns`` builds a segment's rows as Arrow, a column at a time."""
