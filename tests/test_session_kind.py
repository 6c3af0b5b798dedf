"""A Spark Connect client process exits at once when its server is gone (no server, no JVM here)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from cdc_apply.apply.session_kind import server_listens
from cdc_apply.pgserver import free_port


def test_a_connect_client_whose_server_is_gone_exits_at_once() -> None:
    # pyspark's own exit handler asks the server to release the session and retries for minutes
    # (a bench whose server had stopped hung about ten minutes at its end); cdc_apply closes the
    # channel first when nothing listens there.
    script = textwrap.dedent(f"""
        from pyspark.sql import SparkSession
        from cdc_apply.apply.session_kind import remember_url
        url = "sc://127.0.0.1:{free_port()}"
        spark = SparkSession.builder.remote(url).create()
        remember_url(spark, url)
        print("built", flush=True)
    """)
    # A hang, not a speed: the process ends within seconds, or retries for minutes (TimeoutExpired).
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "built" in result.stdout, result.stderr[-2000:]


def test_server_listens_reads_host_and_port_from_a_connect_url() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert server_listens(f"sc://127.0.0.1:{port}")
        assert server_listens(f"sc://127.0.0.1:{port}/;user_id=me;token=x")
    assert not server_listens(f"sc://127.0.0.1:{port}")
    assert not server_listens("sc://127.0.0.1:not-a-port")


def test_the_connect_server_generates_code_unless_the_config_says_otherwise() -> None:
    from cdc_apply.spark.connect_server import server_command

    def factory_mode(command: list[str]) -> list[str]:
        return [arg for arg in command if arg.startswith("spark.sql.codegen.factoryMode=")]

    assert factory_mode(server_command(15002)) == []  # Spark's default: generated code, interpreted where it fails
    overridden = server_command(15002, {"spark.sql.codegen.factoryMode": "NO_CODEGEN"})
    assert factory_mode(overridden) == ["spark.sql.codegen.factoryMode=NO_CODEGEN"]
    assert overridden[overridden.index("spark.connect.grpc.binding.port=15002") - 1] == "--conf"


def test_the_codegen_cache_is_the_connect_servers_and_holds_many_sessions_classes() -> None:
    # Generated classes are cached by class loader, one per Connect session: Spark's 100 were evicted
    # commit after commit by four tables' sessions (docs/spark.md, "Per-command cost on the Connect server").
    from cdc_apply.spark.connect_server import server_command
    from cdc_apply.spark.session import connect_session_conf

    assert "spark.sql.codegen.cache.maxEntries=1000" in server_command(15002)
    assert "spark.sql.codegen.cache.maxEntries=5000" in server_command(15002, {"spark.sql.codegen.cache.maxEntries": "5000"})
    # A static conf: the server sets it, a client session never sends it.
    client = connect_session_conf({"spark.sql.codegen.cache.maxEntries": "5000", "spark.sql.shuffle.partitions": "8"})
    assert "spark.sql.codegen.cache.maxEntries" not in client and client["spark.sql.shuffle.partitions"] == "8"
    # The server-owned SQL confs are one list for both kinds of Connect session (a first one, new_session's).
    from cdc_apply.apply.session_kind import SERVER_SQL_CONFS

    assert not any(key.startswith(SERVER_SQL_CONFS) for key in connect_session_conf({"spark.sql.warehouse.dir": "/w"}))
