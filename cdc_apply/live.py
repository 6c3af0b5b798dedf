"""`cdc-apply run --follow`: the walsender driver of the replication core (``cdc_apply.replication``,
which holds the batching and confirm invariants).

What this driver adds:
- Confirming is a standby status update. When idle, the keepalive's WAL end is the position the
  core's idle advance may confirm.
- A reconnect starts at the slot's confirmed position with a fresh core: the server re-sends
  every transaction not confirmed, and the targets' Delta transaction versions skip the ones
  that were applied but not yet confirmed.
- Batches are written on a writer thread while this thread keeps receiving and decoding the
  next one (the core's "receive while writing"). Only this thread uses the replication
  connection: it sends every status update, also while it waits for a write at
  ``max_changes``, so a long MERGE does not trip ``wal_sender_timeout``.
- A stream silent for ``STALL_INTERVALS`` status intervals counts as lost (``sources.walsender``), and
  reconnects go through ``source.dsn``'s host list with a backoff capped at ``BACKOFF_MAX_S``.
- Under ``changelog.confirm_after: changelog`` the sink only appends to the change log, and a
  ``changelog/follower.TargetFollower`` thread, started after the initial copy, brings the targets up
  from it; its error stops the run.
- A write that fails for a reason of Spark's or the store's (not a ``CdcApplyError``, which names its
  cause and stops the run) ends the session like a lost connection: nothing of it was confirmed, so
  the next session starts at the confirmed position and the targets' versions skip what the failed
  write made durable. Writes are tried again until they have failed for
  ``batching.write_retry_seconds`` with none durable between.
- Slot health (``sources.health``) is checked before each replication connection and every
  ``source.health_interval_seconds`` while it is open; an unusable slot stops the run, it is never
  retried. Every status update sent is the metrics' liveness beat (``/healthz``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import psycopg

from cdc_apply.config import Config
from cdc_apply.errors import CdcApplyError
from cdc_apply.failpoints import failpoint
from cdc_apply.lake.location import StoreAway
from cdc_apply.lsn import format_lsn
from cdc_apply.metrics import MetricsServer, PipelineMetrics
from cdc_apply.parts import run_parts
from cdc_apply.pipeline import prepare_source
from cdc_apply.replication import BatchCut, ReplicationCore
from cdc_apply.runtime import StopFlag
from cdc_apply.sink import RunSummary
from cdc_apply.sources.catalog import SourceCatalog
from cdc_apply.sources.health import HealthMonitor
from cdc_apply.sources.slot import PgOutputOptions, release_stalled_reader, wait_until_caught_up
from cdc_apply.sources.exported_snapshot import SnapshotLost
from cdc_apply.sources.walsender import MAX_READ_FRAMES, STALL_INTERVALS, StreamLost, WalSenderStream

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

WRITER_POLL_S = 0.05  # how often the receive loop looks at a running write
MIN_READ_FRAMES = 64  # a read's cap never goes below this, so a full batch's last read still moves
BACKOFF_START_S = 0.5
# Reconnect attempts are cheap and a failover is waiting on them: after a promotion the new primary
# is found within this many seconds (docs/operations.md, "Failover").
BACKOFF_MAX_S = 5.0


class WriteFailed(CdcApplyError):
    """A batch's write failed for a reason of Spark's or the store's; nothing of it was confirmed."""

    def __init__(self, end_lsn: int, cause: Exception) -> None:
        super().__init__(f"the write of the batch ending at {format_lsn(end_lsn)} failed: {_first_line(cause)}")


def _first_line(error: Exception) -> str:
    """The error's first telling line: py4j's starts with the JVM call it made ("An error occurred
    while calling o123.sql."), the Java exception after it."""
    for line in str(error).splitlines():
        line = line.strip().removeprefix(":").strip()
        if line and not line.startswith("An error occurred while calling"):
            return line[:300]
    return type(error).__name__


class LiveReplicator:
    def __init__(self, config: Config, spark: SparkSession, stop: StopFlag) -> None:
        self.config = config
        self.stop = stop
        self.metrics = PipelineMetrics(config.pipeline, config.source.status_interval_seconds)
        self.metrics_server: MetricsServer | None = None
        self.health = HealthMonitor(config.source, self.metrics)
        self.summary = RunSummary(metrics=self.metrics)
        parts = run_parts(config, spark, self.summary)
        self.applier, self.snapshotter, self.sink = parts.applier, parts.snapshotter, parts.sink
        self.follower = parts.follower
        self.changelog = self.sink.changelog
        self.confirmed = 0
        self.previous_reader: tuple[str, int, int] | None = None  # host, port, backend PID of the last stream
        self.failing_since: float | None = None  # the first failed write since the last durable one

    def run(self) -> RunSummary:
        if self.config.metrics.port is not None:
            self.metrics_server = MetricsServer(self.metrics, self.config.metrics.host, self.config.metrics.port)
        try:
            return self._run()
        except BaseException as exc:
            self.metrics.error(exc)
            raise
        finally:
            if self.follower is not None:
                self.follower.stop()
            if self.metrics_server is not None:
                self.metrics_server.close()

    def _run(self) -> RunSummary:
        options = prepare_source(self.config, self.health)
        backoff = BACKOFF_START_S
        copied = False
        checked = True  # prepare_source has just checked the slot's health
        while not self.stop.event.is_set():
            try:
                if not copied:  # a copy cut short is cleared and done again on the next try
                    self.summary.snapshots += self.snapshotter.sync()
                    copied = True
                    self._start_follower()
                if self._session(options, check_health=not checked):
                    backoff = BACKOFF_START_S
            except (StreamLost, SnapshotLost, psycopg.OperationalError, WriteFailed) as exc:  # retried
                if isinstance(exc, WriteFailed):
                    self._give_up_writing_after(exc)
                self.summary.reconnects += 1
                self.metrics.reconnected(exc)
                log.warning("%s; reconnecting in %.1f s", exc, backoff)
                self.stop.event.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            checked = False
        return self.summary

    def _give_up_writing_after(self, failure: WriteFailed) -> None:
        """Raises ``failure`` once writes have failed for ``batching.write_retry_seconds`` with none
        durable between (``_confirm`` clears the clock), or when it came while stopping."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        budget = self.config.batching.write_retry_seconds
        if self.stop.event.is_set():  # the last write of a stop failed: the run ends with its error
            raise failure
        if now - self.failing_since >= budget:
            failure.args = (f"{failure.args[0]} (writes failing for {now - self.failing_since:.0f} s of "
                            f"batching.write_retry_seconds {budget:g})",)
            raise failure

    def _start_follower(self) -> None:
        """After the initial copy: from then on the targets' changes come from the change log."""
        if self.follower is not None and not self.follower.started:
            assert self.changelog is not None
            self.changelog.ensure()  # on this thread, before the follower reads it
            self.follower.start()

    def _session(self, options: PgOutputOptions, *, check_health: bool) -> bool:
        """One replication connection, until stopped or lost. True when it applied something.

        ``check_health``: check the slot before connecting; false only for the first connection, right
        after ``prepare_source`` checked it."""
        source, batching = self.config.source, self.config.batching
        health_conn = psycopg.connect(source.conninfo(), autocommit=True, connect_timeout=10)
        try:
            self._release_previous_reader(health_conn)
            if check_health:
                self.health.check(health_conn, starting=True)
            stream = WalSenderStream(source.conninfo(), source.slot, options, on_status=self.metrics.beat,
                                     stall_seconds=STALL_INTERVALS * source.status_interval_seconds)
        except BaseException:
            health_conn.close()
            raise
        self.previous_reader = (stream.conn.info.host, stream.conn.info.port, stream.conn.info.backend_pid)
        core = ReplicationCore(self.sink, lambda lsn: self._confirm(stream, lsn),
                               cut=BatchCut(batching.max_changes, batching.max_seconds), confirmed=self.confirmed,
                               spill_bytes=batching.spill_bytes, skip_origins=source.skip_origins,
                               type_facts=SourceCatalog(source.conninfo()).type_facts)
        writer = ThreadPoolExecutor(1, thread_name_prefix="cdc-apply-writer")
        progressed = False
        try:
            stream.start()
            log.info("streaming slot %s of %s", source.slot, source.describe())
            while not self.stop.event.is_set():
                if core.write_done() or core.write_full():
                    # At max_changes pending, receive nothing more until the write is durable.
                    progressed = _finish_write(core, 0 if core.write_done() else WRITER_POLL_S) or progressed
                received = 0 if core.write_full() else self._receive(stream, core)
                if core.write_ready(drained=received == 0):
                    core.start_write(writer)
                if stream.status_due(source.status_interval_seconds):
                    stream.send_status(self.confirmed, reply_requested=True)  # the reply proves the link lives
                if self.health.due():
                    self.health.check(health_conn, own_pid=stream.conn.pgconn.backend_pid)
                if self.follower is not None:
                    self.follower.raise_error()
            # Stopping: finish what was received, so a clean stop loses no work.
            if core.writing:
                progressed = _finish_write(core) or progressed
            if core.pending:
                core.start_write(writer)
                progressed = _finish_write(core) or progressed
        finally:
            core.abandon_write()
            writer.shutdown()
            core.close()
            stream.close()
            health_conn.close()
        return progressed

    def _release_previous_reader(self, conn: psycopg.Connection) -> None:
        """After a stalled stream, its walsender on the server may still hold the slot (until
        ``wal_sender_timeout``): end it, when ``conn`` reached the same server."""
        if self.previous_reader is None:
            return
        host, port, pid = self.previous_reader
        self.previous_reader = None
        if (conn.info.host, conn.info.port) == (host, port) and release_stalled_reader(conn, self.config.source.slot, pid):
            log.warning("ended this pipeline's previous walsender (PID %d), which still held slot %s", pid,
                        self.config.source.slot)

    def _receive(self, stream: WalSenderStream, core: ReplicationCore) -> int:
        """One read of the stream into the core (the number of messages); when idle, the
        keepalive's WAL end may be confirmed."""
        timeout = WRITER_POLL_S if core.writing or core.pending else 1.0
        # A read behind a backlog takes thousands of frames at once: no more than the batch has room
        # for (a message is at most one change), so a batch does not go far past max_changes.
        room = max(MIN_READ_FRAMES, min(MAX_READ_FRAMES, core.room()))
        received = stream.read_frames(timeout=timeout, max_frames=room)
        messages = received.messages
        reply = received.reply_requested
        if len(messages):
            failpoint("after_receive")
            self.metrics.received_changes(core.feed_spans(messages, "walsender"))
        elif received.keepalive_end is not None and core.advance_idle(received.keepalive_end):
            reply = False  # the idle advance sent a status update
        if reply:
            stream.send_status(self.confirmed)
        return len(messages)

    def _confirm(self, stream: WalSenderStream, lsn: int) -> None:
        stream.send_status(lsn)
        self.confirmed = lsn
        self.failing_since = None
        self.summary.confirmed_lsn = lsn
        self.metrics.confirmed_to(lsn)
        log.debug("confirmed slot %s to %s", self.config.source.slot, format_lsn(lsn))


def _finish_write(core: ReplicationCore, timeout: float | None = None) -> bool:
    """``core.finish_write``, its failure for a reason of Spark's or the store's as ``WriteFailed``."""
    end = core.writing_end or 0
    try:
        return core.finish_write(timeout)
    except Exception as exc:
        named = isinstance(exc, (CdcApplyError, psycopg.OperationalError)) and not isinstance(exc, StoreAway)
        if named:  # an error cdc_apply names, or the source lost: as it is
            raise
        raise WriteFailed(end, exc) from exc


class BackgroundReplicator:
    """A LiveReplicator in a thread (demo, benchmarks, tests): ``finish()`` stops it the way SIGTERM
    does, waits, and re-raises whatever ended it early."""

    def __init__(self, config: Config, spark: SparkSession) -> None:
        self.stop = StopFlag()
        self.replicator = LiveReplicator(config, spark, self.stop)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="cdc-apply-follow", daemon=True)

    def _run(self) -> None:
        try:
            self.replicator.run()
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish()
            self.error = exc

    def start(self) -> BackgroundReplicator:
        self.thread.start()
        return self

    def wait_for_snapshots(self) -> None:
        """Until the initial copy is done (the slot exists, the targets are in sync) or the thread ended."""
        while not self.replicator.summary.snapshots and self.thread.is_alive():
            time.sleep(0.2)

    def wait_caught_up(self, timeout: float = 120.0, lsn: int | None = None) -> None:
        """Until the slot is confirmed up to ``lsn`` (default: the server's WAL position now), and
        the targets hold what the change log holds then; raises what ended the pipeline if it
        stops first."""
        source = self.replicator.config.source
        started = time.monotonic()
        try:
            wait_until_caught_up(source.conninfo(), source.slot, timeout, running=self.thread.is_alive, lsn=lsn)
        except RuntimeError:
            if self.error is not None:
                raise self.error from None
            raise
        follower, changelog = self.replicator.follower, self.replicator.changelog
        if follower is not None and changelog is not None and changelog.version is not None:
            # confirm_after: changelog: the slot is confirmed at the log; the targets follow it.
            if not follower.wait_for(changelog.version, max(0.0, timeout - (time.monotonic() - started))):
                follower.raise_error()
                raise RuntimeError(f"the targets did not catch up with the change log in {timeout} s")

    def finish(self, timeout: float | None = None) -> RunSummary:
        self.stop.event.set()
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.replicator.summary

    def __enter__(self) -> BackgroundReplicator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.finish(timeout=120)


def follow(config: Config, spark: SparkSession, stop: StopFlag) -> RunSummary:
    return LiveReplicator(config, spark, stop).run()

