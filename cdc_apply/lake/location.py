"""Where files live: one location type for a local directory and an object-store URI alike.

A ``Location`` is a local absolute path or ``scheme://authority/key`` (``s3a://``, ``s3://``,
``abfss://``, ``gs://``; ``file://`` is local). Paths are never joined by hand: ``child`` appends
names that are one component each, and ``under`` resolves a relative path (a ``path_template``'s
result) and refuses one that would leave the location. ``Storage`` reaches a location's store from
Python (the pipeline's state, `cdc-apply status`, delta-rs), with the endpoint and credentials the
Spark config gives Hadoop's S3A, or the AWS default chain; it never prints a secret.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from cdc_apply.errors import CdcApplyError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/?#]*)([^?#]*)$")
S3_SCHEMES = ("s3a", "s3", "s3n")
S3A = "spark.hadoop.fs.s3a."
log = logging.getLogger(__name__)
T = TypeVar("T")

# What an object store answers when it is away or busy, in pyarrow's words (the AWS SDK's error
# names, or a 5xx status): worth asking again. A refused credential or a missing bucket is not.
_TRANSIENT = re.compile(r"NETWORK_CONNECTION|SERVICE_UNAVAILABLE|SLOW_DOWN|THROTTLING|INTERNAL_FAILURE|"
                        r"REQUEST_TIMEOUT|HTTP status 5\d\d|Connection refused|timed out", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|min)?\s*$")


class StorageError(CdcApplyError):
    pass


class StoreAway(StorageError):
    """The store still answered as if away or busy when S3A's retries ran out (``Storage._retrying``)."""


# The escape itself, path separators, what Hadoop paths or globs read specially (":" makes a URI
# scheme) and "%", which delta-rs percent-decodes in a table's path (so "%" cannot be the escape).
PATH_ESCAPE = "~"
_ENCODED_PATH_CHARACTERS = frozenset('~%/\\:*?[]{}#"<>|')


def path_component(identifier: str) -> str:
    """A PostgreSQL identifier as one safe path component, injectively (docs/apply.md, "Target paths").

    Printable characters stay as they are, so ``public``, ``order_items`` and ``Mixed Case`` keep
    their names; ``~`` (the escape), ``%``, path separators, characters Hadoop paths and globs read
    specially, anything unprintable and a leading dot become ``~XX`` per UTF-8 byte: ``..`` becomes
    ``~2E.``, ``a/b`` becomes ``a~2Fb``.
    """
    out = []
    for position, character in enumerate(identifier):
        if character in _ENCODED_PATH_CHARACTERS or not character.isprintable() or (character == "." and position == 0):
            out.append("".join(f"{PATH_ESCAPE}{byte:02X}" for byte in character.encode("utf-8", "surrogatepass")))
        else:
            out.append(character)
    return "".join(out) or PATH_ESCAPE  # an empty name (never a PostgreSQL one): "~" alone, which no name encodes to


@dataclass(frozen=True, order=True)
class Location:
    scheme: str  # "" for the local file system
    authority: str  # a bucket, container@account; "" locally
    key: str  # "/"-separated components, no leading or trailing "/": the path under the authority (or under "/")

    @classmethod
    def parse(cls, text: str | Location) -> Location:
        if isinstance(text, Location):
            return text
        match = _URI.match(text)
        if match is None:
            return cls("", "", _components(os.path.abspath(text)))
        scheme, authority, path = match[1].lower(), match[2], match[3]
        if scheme == "file":
            if authority not in ("", "localhost"):
                raise ValueError(f"{text!r}: a file:// URI names no host (file:///path)")
            return cls("", "", _components(posixpath.normpath(path or "/")))
        if not authority:
            raise ValueError(f"{text!r}: names no bucket or container ({scheme}://bucket/path)")
        if any(part in (".", "..") for part in path.split("/")):
            raise ValueError(f"{text!r}: a '.' or '..' component")
        return cls(scheme, authority, _components(path))

    @property
    def local(self) -> bool:
        return self.scheme == ""

    def __str__(self) -> str:
        if self.local:
            return "/" + self.key
        return f"{self.scheme}://{self.authority}" + (f"/{self.key}" if self.key else "")

    def path(self) -> Path:
        """The local path; only for a local location."""
        if not self.local:
            raise ValueError(f"{self} is not on the local file system")
        return Path(str(self))

    def child(self, *names: str) -> Location:
        """This location with each of ``names`` appended as one component."""
        for name in names:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"not a single path component: {name!r}")
        return Location(self.scheme, self.authority, "/".join(filter(None, (self.key, *names))))

    def under(self, relative: str) -> Location:
        """``relative`` resolved under this location; ``ValueError`` if it is absolute or would leave it."""
        if relative.startswith("/") or "\\" in relative or re.match(r"^[A-Za-z]:", relative) or _URI.match(relative):
            raise ValueError(f"{relative!r} is not a relative path")
        resolved = posixpath.normpath(posixpath.join("/", self.key, relative)).lstrip("/")
        inside = Location(self.scheme, self.authority, resolved)
        if not inside.is_strictly_under(self):
            raise ValueError(f"{relative!r} leads to {inside}, which is not under {self}")
        return inside

    def is_strictly_under(self, other: Location) -> bool:
        if (self.scheme, self.authority) != (other.scheme, other.authority) or self.key == other.key:
            return False
        return not other.key or self.key.startswith(other.key + "/")

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]


def _components(path: str) -> str:
    return "/".join(part for part in path.split("/") if part)


@dataclass(frozen=True)
class Storage:
    """How Python reaches a store: Hadoop S3A's settings from the config's ``spark:`` section
    (``spark.hadoop.fs.s3a.endpoint``, ``access.key``, ``secret.key``, ``session.token``,
    ``path.style.access``, ``endpoint.region``, ``connection.ssl.enabled``), else the AWS default chain
    (environment, profile, instance role). Other schemes use pyarrow's own defaults."""

    s3a: Mapping[str, str] = field(default_factory=dict)  # the part after "spark.hadoop.fs.s3a."

    @classmethod
    def from_spark_conf(cls, conf: Mapping[str, object]) -> Storage:
        return cls({k[len(S3A):]: str(v) for k, v in conf.items() if k.startswith(S3A)})

    def __repr__(self) -> str:  # never the keys
        return f"Storage(s3a settings: {', '.join(sorted(k for k in self.s3a if 'key' not in k and 'token' not in k))})"

    def retry_delays(self) -> list[float]:
        """Seconds to wait before each new attempt of a request an object store failed transiently:
        S3A's own policy, so that Python rides out what Spark's writes ride out. ``fs.s3a.retry.limit``
        attempts more (7 by default), the first after ``fs.s3a.retry.interval`` (500ms), each wait
        twice the last: 63.5 s in all by default."""
        limit_text = self.s3a.get("retry.limit", "7").strip()
        if not limit_text.isdigit():
            raise StorageError(f"spark.hadoop.fs.s3a.retry.limit {limit_text!r}: not a whole number of attempts")
        limit = int(limit_text)
        match = _DURATION.match(self.s3a.get("retry.interval", "500ms"))
        if match is None:
            raise StorageError(f"spark.hadoop.fs.s3a.retry.interval {self.s3a['retry.interval']!r}: "
                               "not a duration (500ms, 2s, 1m)")
        unit = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0}[match.group(2) or "ms"]
        interval = int(match.group(1)) * unit
        return [interval * 2 ** attempt for attempt in range(limit)]

    def _retrying(self, location: Location, doing: str, request: Callable[[], T], *, not_found: bool = False) -> T:
        """``request()``, asked again after S3A's waits while the store answers as if away or busy;
        then a StorageError naming the location and what was being done. ``not_found``: a
        FileNotFoundError is the caller's to handle (a missing object read or deleted)."""
        delays = [] if location.local else self.retry_delays()
        for attempt in range(len(delays) + 1):
            try:
                return request()
            except FileNotFoundError:
                if not_found:
                    raise
                raise StorageError(f"{location}: cannot {doing}: not found") from None
            except OSError as exc:
                reason = self._scrubbed(_reason(exc))
                transient = _TRANSIENT.search(str(exc)) is not None
                if attempt == len(delays) or not transient:
                    raise (StoreAway if transient else StorageError)(f"{location}: cannot {doing}: {reason}") from None
                log.warning("%s: cannot %s (%s); asking again in %.1f s (attempt %d of %d)", location, doing,
                            reason, delays[attempt], attempt + 2, len(delays) + 1)
                time.sleep(delays[attempt])
        raise AssertionError("unreachable")

    def filesystem(self, location: Location) -> tuple[pafs.FileSystem, str]:
        """pyarrow's file system for ``location`` and the location's path in it."""
        import pyarrow.fs as pafs

        if location.local:
            return pafs.LocalFileSystem(), str(location)
        path = f"{location.authority}/{location.key}".rstrip("/")
        if location.scheme in S3_SCHEMES:
            return self._s3(), path
        try:
            filesystem, _ = pafs.FileSystem.from_uri(f"{location.scheme}://{location.authority}")
        except (ValueError, OSError) as exc:
            raise StorageError(f"{location}: pyarrow cannot reach {location.scheme}:// ({exc})") from None
        return filesystem, path

    def _s3(self) -> pafs.FileSystem:
        import pyarrow.fs as pafs

        endpoint = self.s3a.get("endpoint")
        secure = self.s3a.get("connection.ssl.enabled", "true").lower() != "false"
        scheme = "https" if secure else "http"
        if endpoint and "://" in endpoint:
            scheme, _, endpoint = endpoint.partition("://")
        options: dict[str, object] = {"scheme": scheme}
        if endpoint:
            options["endpoint_override"] = endpoint.rstrip("/")
        if self.s3a.get("access.key"):
            options["access_key"] = self.s3a["access.key"]
            options["secret_key"] = self.s3a.get("secret.key", "")
            if self.s3a.get("session.token"):
                options["session_token"] = self.s3a["session.token"]
        region = self.s3a.get("endpoint.region") or os.environ.get("AWS_REGION")
        if region:
            options["region"] = region
        # pyarrow addresses buckets by path under an endpoint override, by host name on AWS itself
        return pafs.S3FileSystem(**options)  # type: ignore[arg-type]

    def delta_rs_options(self, location: Location) -> dict[str, str]:
        """Storage options for delta-rs (``DeltaTable(uri, storage_options=...)``) of ``location``."""
        if location.scheme not in S3_SCHEMES:
            return {}
        options = {}
        endpoint = self.s3a.get("endpoint")
        if endpoint:
            secure = self.s3a.get("connection.ssl.enabled", "true").lower() != "false"
            options["AWS_ENDPOINT_URL"] = endpoint if "://" in endpoint else f"{'https' if secure else 'http'}://{endpoint}"
            options["AWS_ALLOW_HTTP"] = "true"
        for ours, theirs in (("access.key", "AWS_ACCESS_KEY_ID"), ("secret.key", "AWS_SECRET_ACCESS_KEY"),
                             ("session.token", "AWS_SESSION_TOKEN"), ("endpoint.region", "AWS_REGION")):
            if self.s3a.get(ours):
                options[theirs] = self.s3a[ours]
        options.setdefault("AWS_REGION", os.environ.get("AWS_REGION", "us-east-1"))
        if self.s3a.get("path.style.access", "false").lower() == "true":
            options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
        return options

    def delta_rs_uri(self, location: Location) -> str:
        """delta-rs names S3 ``s3://`` whatever Hadoop calls it."""
        return f"s3://{location.authority}/{location.key}" if location.scheme in S3_SCHEMES else str(location)

    def check(self, location: Location, what: str) -> None:
        """Fail fast, naming ``what`` (a config key): a bucket that does not exist, credentials or an
        endpoint the store refuses. Local locations need nothing."""
        if location.local:
            return
        import pyarrow.fs as pafs

        filesystem, _ = self.filesystem(location)
        try:
            info = filesystem.get_file_info(location.authority)
        except OSError as exc:
            raise StorageError(f"{what} {location}: the store refused the request: {self._scrubbed(_reason(exc))} "
                               f"(endpoint {self.s3a.get('endpoint', 'AWS')}; credentials from "
                               f"spark.hadoop.fs.s3a.access.key/secret.key or the AWS default chain)") from None
        if info.type == pafs.FileType.NotFound:
            raise StorageError(f"{what} {location}: bucket {location.authority!r} does not exist "
                               f"(endpoint {self.s3a.get('endpoint', 'AWS')})")

    def _scrubbed(self, text: str) -> str:
        for key, value in self.s3a.items():
            if ("key" in key or "token" in key) and value:
                text = text.replace(value, "***")
        return text

    # -- documents: small objects, each written whole by one writer -----------------------------

    def read_text(self, location: Location) -> str | None:
        """The object's text, None when there is none."""
        filesystem, path = self.filesystem(location)
        if location.local and not Path(path).is_file():
            return None

        def read() -> str:
            with filesystem.open_input_stream(path) as stream:
                return stream.read().decode("utf-8")

        try:
            return self._retrying(location, "read", read, not_found=True)
        except FileNotFoundError:
            return None

    def input_file(self, location: Location) -> pa.NativeFile:
        """The object opened for random access (a Parquet reader takes only the columns it needs);
        the open is asked again while the store is away, as every request here is."""
        filesystem, path = self.filesystem(location)
        return self._retrying(location, "open", lambda: filesystem.open_input_file(path))

    def write_text(self, location: Location, text: str) -> None:
        """``text`` at ``location``, found by a reader whole or as it was: an object store's PUT is
        atomic; a local file is written beside and renamed over, after an fsync."""
        if location.local:
            path = location.path()
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
            return
        filesystem, path = self.filesystem(location)

        def write() -> None:
            with filesystem.open_output_stream(path) as stream:
                stream.write(text.encode("utf-8"))

        self._retrying(location, "write", write)

    def write_with(self, location: Location, doing: str, write: Callable[[pa.NativeFile], None]) -> None:
        """An object (or local file, its directory made) written by ``write(stream)``, written again
        while the store is away; ``doing`` names it in an error."""
        filesystem, path = self.filesystem(location)
        if location.local:
            location.path().parent.mkdir(parents=True, exist_ok=True)

        def written() -> None:
            with filesystem.open_output_stream(path) as stream:
                write(stream)

        self._retrying(location, doing, written)

    def delete(self, location: Location) -> None:
        filesystem, path = self.filesystem(location)
        if location.local and not Path(path).exists():
            return
        try:
            self._retrying(location, "delete", lambda: filesystem.delete_file(path), not_found=True)
        except FileNotFoundError:
            pass

    def names(self, location: Location) -> list[str]:
        """The names directly under ``location`` (none when it does not exist)."""
        return sorted(self.entries(location))

    def entries(self, location: Location) -> dict[str, tuple[int | None, int | None]]:
        """The names directly under ``location``, each with its size and modification time (ns)."""
        import pyarrow.fs as pafs

        filesystem, path = self.filesystem(location)
        infos = self._retrying(location, "list", lambda: filesystem.get_file_info(
            pafs.FileSelector(path, allow_not_found=True)))
        return {info.base_name: (info.size, info.mtime_ns) for info in infos}


@dataclass(frozen=True)
class FileRoot:
    """A table's directory, into which files are written outside Delta's writer (the copy's tasks, the
    change log's appends): small and picklable, a copy task gets it, with the storage to reach it."""

    location: Location
    storage: Storage = field(default_factory=Storage)

    @classmethod
    def of(cls, root: str | Location | FileRoot) -> FileRoot:
        return root if isinstance(root, FileRoot) else cls(Location.parse(root))

    def file(self, relative: str) -> tuple[pafs.FileSystem, str]:
        """pyarrow's file system and the path in it of ``relative`` ("/"-separated) under the root."""
        filesystem, base = self.storage.filesystem(self.location)
        return filesystem, f"{base}/{relative}"


def _reason(exc: OSError) -> str:
    """pyarrow's message without anything after a newline (request ids, headers)."""
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
