"""The spark-submit entry point: `spark-submit jobs/apply_changes.py --config conf/x.yaml [--once|--follow]`.

It runs `cdc-apply run` inside the driver spark-submit started, on whatever master it was given
(`local[*]`, `spark://host:port`, ...). The Delta jars come from cdc_apply's cache: they are added
to the driver's class loader and shipped to the executors through `spark.jars`, so no `--jars` or
`--packages` is needed. Exit codes are the CLI's (0 ok, 1 failure, 2 config error).
"""

from __future__ import annotations

import sys

from cdc_apply.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
