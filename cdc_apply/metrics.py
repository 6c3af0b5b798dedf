"""Prometheus metrics and ``/healthz`` for the long-running verbs (`run --follow`, `stream`).

Every metric is listed in docs/operations.md. Each pipeline has its own registry, so two
pipelines in one process (tests, a notebook) do not mix their numbers; the ``pipeline`` label
is there for the scraper's side.

``/healthz`` answers 200 while the loop is alive, and 503 once no status update (walsender) or
trigger (Structured Streaming) has been seen for twice the interval the loop promises: the
process is wedged. Before the first one (the initial copy) it answers 200 "starting".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from cdc_apply.sources.health import SlotHealth

if TYPE_CHECKING:
    from cdc_apply.apply.batch import BatchResult
    from cdc_apply.transactions import Transaction

log = logging.getLogger(__name__)

LAG_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
APPLY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


class PipelineMetrics:
    def __init__(self, pipeline: str, beat_interval_s: float) -> None:
        self.pipeline = pipeline
        self.beat_interval_s = beat_interval_s
        self.registry = CollectorRegistry()
        self.last_beat: float | None = None  # monotonic time of the last status update or trigger
        r, p = self.registry, ["pipeline"]
        self.lag = Histogram("cdc_apply_commit_to_delta_lag_seconds", "PostgreSQL commit -> visible in Delta, "
                             "per transaction", p, buckets=LAG_BUCKETS, registry=r).labels(pipeline)
        self.batch_seconds = Histogram("cdc_apply_batch_apply_seconds", "Time to apply one batch to every target",
                                       p, buckets=APPLY_BUCKETS, registry=r).labels(pipeline)
        self.received = Counter("cdc_apply_changes_received", "Row changes received in committed transactions",
                                p, registry=r).labels(pipeline)
        self.applied = Counter("cdc_apply_changes_applied", "Row changes applied to Delta targets (skipped "
                               "duplicates not counted)", p, registry=r).labels(pipeline)
        self.reconnects = Counter("cdc_apply_reconnects", "Replication connections lost and opened again", p,
                                  registry=r).labels(pipeline)
        self.errors = Counter("cdc_apply_errors", "Errors by kind (exception class)", [*p, "kind"], registry=r)
        self.retained = Gauge("cdc_apply_slot_retained_wal_bytes", "pg_current_wal_lsn() - restart_lsn of the slot",
                              p, registry=r).labels(pipeline)
        self.unconfirmed = Gauge("cdc_apply_slot_unconfirmed_bytes", "pg_current_wal_lsn() - confirmed_flush_lsn "
                                 "of the slot", p, registry=r).labels(pipeline)
        self.confirmed = Gauge("cdc_apply_confirmed_lsn", "The LSN the slot was last confirmed to (as a number)", p,
                               registry=r).labels(pipeline)
        self.last_status = Gauge("cdc_apply_last_status_timestamp_seconds", "Unix time of the last status update "
                                 "or trigger (what /healthz watches)", p, registry=r).labels(pipeline)
        self.changelog_lag = Histogram("cdc_apply_commit_to_changelog_lag_seconds", "PostgreSQL commit -> durable "
                                       "in the change log, per transaction", p, buckets=LAG_BUCKETS,
                                       registry=r).labels(pipeline)
        self.changelog_lsn = Gauge("cdc_apply_changelog_lsn", "Commit LSN of the last transaction appended to the "
                                   "change log", p, registry=r).labels(pipeline)
        self.targets_lsn = Gauge("cdc_apply_targets_applied_lsn", "confirm_after: changelog: the commit LSN up to "
                                 "which every target holds the change log", p, registry=r).labels(pipeline)
        self.table_changes = Counter("cdc_apply_table_changes", "Changes applied to a table, by operation "
                                     "(I insert, U update, D delete, T truncate)", [*p, "table", "op"], registry=r)
        self.table_lsn = Gauge("cdc_apply_table_last_commit_lsn", "Commit LSN of the last transaction applied "
                               "to the table", [*p, "table"], registry=r)
        self.table_ts = Gauge("cdc_apply_table_last_commit_timestamp_seconds", "PostgreSQL commit time (Unix) of "
                              "the last transaction applied to the table", [*p, "table"], registry=r)

    # ---- what the loops report

    def received_changes(self, count: int) -> None:
        self.received.inc(count)

    def batch_applied(self, result: BatchResult, transactions: Iterable[Transaction], lags: list[float]) -> None:
        from cdc_apply.lsn import pg_us_to_unix_us

        self.batch_seconds.observe(result.seconds)
        for lag in lags:
            self.lag.observe(max(lag, 0.0))
        commit_ts = {t.commit_lsn: pg_us_to_unix_us(t.commit_ts) / 1e6 for t in transactions}
        for table in result.tables:
            if table.skipped:
                continue
            for op, count in table.ops.items():
                self.table_changes.labels(self.pipeline, table.table, op).inc(count)
                self.applied.inc(count)
            if table.last_lsn is not None:
                self.table_lsn.labels(self.pipeline, table.table).set(table.last_lsn)
                if table.last_lsn in commit_ts:
                    self.table_ts.labels(self.pipeline, table.table).set(commit_ts[table.last_lsn])

    def changelog_appended(self, last_lsn: int, lags: list[float]) -> None:
        self.changelog_lsn.set(last_lsn)
        for lag in lags:
            self.changelog_lag.observe(max(lag, 0.0))

    def targets_applied(self, lsn: int) -> None:
        self.targets_lsn.set(lsn)

    def reconnected(self, error: BaseException) -> None:
        self.reconnects.inc()
        self.error(error)

    def error(self, error: BaseException) -> None:
        self.errors.labels(self.pipeline, type(error).__name__).inc()

    def confirmed_to(self, lsn: int) -> None:
        self.confirmed.set(lsn)

    def beat(self) -> None:
        """A status update was sent (or a trigger seen): the loop is alive."""
        self.last_beat = time.monotonic()
        self.last_status.set(time.time())

    def observe_slot(self, health: SlotHealth) -> None:
        if health.retained_wal_bytes is not None:
            self.retained.set(health.retained_wal_bytes)
        if health.unconfirmed_bytes is not None:
            self.unconfirmed.set(health.unconfirmed_bytes)

    # ---- what /healthz says

    def health(self, now: float | None = None) -> tuple[bool, str]:
        if self.last_beat is None:
            return True, "starting"
        silent = (time.monotonic() if now is None else now) - self.last_beat
        if silent > 2 * self.beat_interval_s:
            return False, f"wedged: no status update for {silent:.0f} s (limit {2 * self.beat_interval_s:.0f} s)"
        return True, "ok"

    def wsgi_app(self) -> Callable[[dict[str, Any], Callable[..., Any]], list[bytes]]:
        metrics_app = make_wsgi_app(self.registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            if environ.get("PATH_INFO") == "/healthz":
                healthy, text = self.health()
                start_response("200 OK" if healthy else "503 Service Unavailable",
                               [("Content-Type", "text/plain; charset=utf-8")])
                return [text.encode() + b"\n"]
            return metrics_app(environ, start_response)  # type: ignore[no-any-return]

        return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class MetricsServer:
    """``/metrics`` and ``/healthz`` over HTTP in a daemon thread, until ``close()``."""

    def __init__(self, metrics: PipelineMetrics, host: str, port: int) -> None:
        self.httpd = make_server(host, port, metrics.wsgi_app(), ThreadingWSGIServer, handler_class=_QuietHandler)
        self.port = int(self.httpd.server_port)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="cdc-apply-metrics", daemon=True)
        self.thread.start()
        log.info("metrics on http://%s:%d/metrics, health on /healthz", host, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()
