"""spark-submit entry point for the Structured Streaming apply.

    spark-submit jobs/stream_changes.py --config conf/example.yaml

The same as ``cdc-apply stream --config ...``: ``spark.readStream.format("pgoutput")`` ->
``foreachBatch(cdc_apply.spark.foreach_batch(config))`` -> Delta, checkpointed.
"""

from __future__ import annotations

import sys

from cdc_apply.cli import main

if __name__ == "__main__":
    sys.exit(main(["stream", *sys.argv[1:]]))
