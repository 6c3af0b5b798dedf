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


def _model_keys(model: type, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every key path of a config model; ``*`` stands for a mapping's user-chosen key (a table
    pattern, a column name)."""
    import typing

    from pydantic import BaseModel

    paths = set()
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        path = prefix + (name,)
        paths.add(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths |= _model_keys(annotation, path)
        elif typing.get_origin(annotation) is dict:
            value = typing.get_args(annotation)[1]
            if isinstance(value, type) and issubclass(value, BaseModel):
                paths |= _model_keys(value, path + ("*",))
    return paths


def _holds(document: object, path: tuple[str, ...]) -> bool:
    if not path:
        return True
    if not isinstance(document, dict):
        return False
    head, rest = path[0], path[1:]
    if head == "*":
        return any(_holds(value, rest) for value in document.values())
    return head in document and _holds(document[head], rest)


def test_the_example_config_and_the_reference_name_every_key() -> None:
    """conf/example.yaml shows every key of the config model (a key that cannot be set beside another,
    such as ``password_file``, as a comment ``# key: value``), and docs/config.md documents each."""
    import re
    from pathlib import Path

    import yaml

    from cdc_apply.config import Config

    text = Path("conf/example.yaml").read_text()
    uncommented = re.sub(r"(?m)^(\s*)# ([A-Za-z_][\w.]*: )", r"\1\2", text)
    example = yaml.safe_load(uncommented)
    keys = _model_keys(Config)
    per_table = _model_keys(Config.model_fields["defaults"].annotation)  # type: ignore[arg-type]
    missing = sorted(".".join(path) for path in keys if path[0] not in ("defaults", "tables")
                     and not _holds(example, path))
    # A per-table key is shown under ``defaults`` or under one of the table patterns.
    missing += sorted(f"(per table) {'.'.join(path)}" for path in per_table
                      if not _holds(example["defaults"], path) and not _holds(example["tables"], ("*",) + path))
    assert not missing, f"conf/example.yaml lacks {missing}"

    reference = Path("docs/config.md").read_text()
    rows = [line for line in reference.splitlines() if line.startswith("| `")]
    undocumented = []
    def sections(paths: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
        return {path[:n] for path in paths for n in range(1, len(path))}

    for path in keys - sections(keys):
        if path[0] in ("defaults", "tables"):
            continue
        dotted = ".".join(path)
        if f"`{dotted}`" in reference:
            continue
        # A row that names several keys of one section: `source.host`, `port`, ...
        if not any(line.startswith(f"| `{'.'.join(path[:-1])}.") and f"`{path[-1]}`" in line.split("|")[1]
                   for line in rows):
            undocumented.append(dotted)
    undocumented += [".".join(path) for path in per_table - sections(per_table)
                     if not any(f"`{path[0]}" in line.split("|")[1] for line in rows)]
    assert not undocumented, f"docs/config.md does not document {sorted(undocumented)}"


def test_spark_confs_and_table_properties_take_bare_yaml_numbers_and_booleans(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_text("spark:\n  spark.sql.shuffle.partitions: 4\n  spark.sql.adaptive.enabled: false\n"
                    "  spark.memory.fraction: 0.5\ntarget:\n  properties:\n    delta.appendOnly: true\n"
                    "tables:\n  public.t:\n    properties:\n      delta.checkpointInterval: 20\n")
    config = load_config(str(path))
    assert config.spark == {"spark.sql.shuffle.partitions": "4", "spark.sql.adaptive.enabled": "false",
                            "spark.memory.fraction": "0.5"}
    assert config.target.properties == {"delta.appendOnly": "true"}
    assert config.tables["public.t"].properties == {"delta.checkpointInterval": "20"}
    path.write_text("spark:\n  spark.sql.shuffle.partitions: [4]\n")
    with pytest.raises(ConfigError, match=r"shuffle\.partitions.*valid string"):
        load_config(str(path))
