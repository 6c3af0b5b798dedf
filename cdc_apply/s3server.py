"""A local S3-compatible server for the tests and benchmarks: versitygw serving a directory.

versitygw (Apache 2.0) is built once from the Go module proxy by ``./dev setup`` into
``~/.cache/cdc_apply/bin`` (``CDC_APPLY_VERSITYGW`` names another binary). Its ``posix`` backend
keeps each bucket as a directory under the server's root, so a stopped server keeps its objects and
a restarted one serves them again on the same port.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cdc_apply.lake.location import S3A, Storage
from cdc_apply.pgserver import free_port, wait_until_listening

VERSITYGW_MODULE = "github.com/versity/versitygw/cmd/versitygw"
VERSITYGW_VERSION = "v1.8.0"
REGION = "us-east-1"


def versitygw_binary() -> Path:
    configured = os.environ.get("CDC_APPLY_VERSITYGW")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cdc_apply" / "bin"
    return base / f"versitygw-{VERSITYGW_VERSION}"


def build_versitygw() -> Path:
    """``go install`` versitygw into the cache, once (the Go toolchain and its module proxy needed)."""
    binary = versitygw_binary()
    if binary.exists():
        return binary
    if shutil.which("go") is None:
        raise RuntimeError(f"versitygw is not at {binary} and there is no Go toolchain to build it "
                           f"(go install {VERSITYGW_MODULE}@{VERSITYGW_VERSION})")
    with tempfile.TemporaryDirectory() as gobin:
        subprocess.run(["go", "install", f"{VERSITYGW_MODULE}@{VERSITYGW_VERSION}"], check=True,
                       env={**os.environ, "GOBIN": gobin}, capture_output=True)
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(gobin) / "versitygw"), binary)
    return binary


@dataclass
class S3Server:
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="cdc-apply-s3-")))
    access_key: str = "cdc-apply-test"
    secret_key: str = field(default_factory=lambda: uuid.uuid4().hex)
    port: int = 0
    _process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.root.parent / f"{self.root.name}.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> S3Server:
        binary = versitygw_binary()
        if not binary.exists():
            raise RuntimeError(f"versitygw is not built at {binary}: run ./dev setup (it needs the Go toolchain)")
        self.port = self.port or free_port()
        with open(self.log, "ab") as log:  # the server's own descriptor stays open; ours need not
            self._process = subprocess.Popen(
                [str(binary), "--access", self.access_key, "--secret", self.secret_key, "--region", REGION,
                 "--port", f"127.0.0.1:{self.port}", "posix", str(self.root)], stdout=log, stderr=log)
        wait_until_listening(self._process, self.port, timeout, "versitygw", str(self.log))
        return self

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        if self.running():
            assert self._process is not None
            self._process.terminate()
            self._process.wait(timeout=30)
        self._process = None

    def __enter__(self) -> S3Server:
        return self if self.running() else self.start()

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
        if kind is None:  # the log is kept only to explain a failure
            self.log.unlink(missing_ok=True)

    def create_bucket(self, name: str) -> str:
        import pyarrow.fs as pafs

        filesystem = pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key, region=REGION,
                                       endpoint_override=self.endpoint.removeprefix("http://"), scheme="http",
                                       allow_bucket_creation=True)
        filesystem.create_dir(name)
        return name

    def spark_conf(self, *, secret_key: str | None = None) -> dict[str, str]:
        """The ``spark:`` settings that reach this server (what a user sets for their own endpoint)."""
        return {f"{S3A}endpoint": self.endpoint, f"{S3A}endpoint.region": REGION, f"{S3A}path.style.access": "true",
                f"{S3A}connection.ssl.enabled": "false", f"{S3A}access.key": self.access_key,
                f"{S3A}secret.key": secret_key or self.secret_key}

    def storage(self) -> Storage:
        return Storage.from_spark_conf(self.spark_conf())
