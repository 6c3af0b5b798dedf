"""Config validation: every error names the key path; `cdc-apply validate` and its exit codes."""

from __future__ import annotations

import pytest

from cdc_apply.apply.options import apply_options
from cdc_apply.config import ConfigError, load_config, parse_config
from tests.test_decode_cli import _cli


def test_example_config_is_valid_and_maps_to_apply_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = load_config("conf/example.yaml")
    options = apply_options(config)
    assert options.pipeline == "orders_cdc"
    assert options.for_table("public", "orders").delete_mode == "soft"
    assert options.for_table("public", "audit_2024").include is False
    assert options.for_table("public", "events").keys == ("event_id",)
    assert options.for_table("sales", "x").schema_policy == "lenient"


@pytest.mark.parametrize("data,message", [
    ({"sorce": {}}, "sorce: unknown key"),
    ({"tables": {"public.orders": {"delete_mode": "gone"}}}, "tables.\"public.orders\".delete_mode: must be one of 'hard' or 'soft'"),
    ({"tables": {"public.t": {"schema_policy": "x"}}}, "schema_policy: must be one of"),
    ({"tables": {"public.t": {"scd_type": 3}}}, "scd_type: must be one of 1 or 2"),
    ({"source": {"port": 0}}, "source.port: Input should be greater than or equal to 1"),
    ({"source": {"password_env": "A", "password_file": "/x"}}, "source: set password_env or password_file"),
    ({"batching": {"max_changes": 0}}, "batching.max_changes"),
    ({"pipeline": "has space"}, "pipeline: String should match pattern"),
    ({"target": {"name_template": "lake.{tabel}"}}, "target.name_template: may use only plain {schema} and {table}"),
    ({"target": {"path_template": "{schema}/{table"}}, "target.path_template: not a valid template"),
    ({"batching": {"parallel_tables": 0}}, "batching.parallel_tables: Input should be greater than or equal to 1"),
    ({"snapshot": {"chunk_rows": 0}}, "snapshot.chunk_rows"),
    ({"snapshot": {"enable": True}}, "snapshot.enable: unknown key"),
    ([1, 2], "must be a mapping"),
])
def test_config_errors_name_the_key_path(data, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as raised:
        parse_config(data, "x.yaml")
    assert message in str(raised.value) and str(raised.value).startswith("x.yaml")


def test_password_comes_from_env_or_file_and_is_not_described(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    config = parse_config({"source": {"password_file": str(secret), "user": "u"}})
    assert "password=s3cret" in config.source.conninfo() and "s3cret" not in config.source.describe()
    monkeypatch.setenv("PGPW_TEST", "fromenv")
    assert "password=fromenv" in parse_config({"source": {"password_env": "PGPW_TEST"}}).source.conninfo()
    with pytest.raises(ConfigError, match="source.password_env: environment variable NOPE_X is not set"):
        parse_config({"source": {"password_env": "NOPE_X"}}).source.conninfo()


def test_validate_verb_exit_codes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ok = _cli("validate", "conf/example.yaml")
    assert ok.returncode == 0 and "valid" in ok.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("target:\n  warehouse: w\n  colour: blue\n")
    result = _cli("validate", str(bad))
    assert result.returncode == 2 and f"{bad}: target.colour: unknown key" in result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1,\n")
    result = _cli("validate", str(broken))
    assert result.returncode == 2 and f"{broken}:" in result.stderr and "not valid YAML" in result.stderr
