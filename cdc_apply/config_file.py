"""A config file read safely into plain values, before the model checks them (``config.py``):
its size, UTF-8, a key given twice, alias expansion ("billion laughs") and nesting depth, each
refused with the file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from cdc_apply.errors import ConfigError

MAX_ECHO_CHARS = 80  # of a value or key shown in an error
MAX_CONFIG_BYTES = 1024 * 1024
MAX_CONFIG_NODES = 100_000  # counted with aliases expanded: a "billion laughs" file is refused
MAX_CONFIG_DEPTH = 32


class _ConfigLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (the last one would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the base class reports it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {str(key)[:MAX_ECHO_CHARS]!r} appears twice (first at line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _check_size(node: yaml.Node, where: str) -> None:
    """Node count with aliases expanded, and depth, computed without expanding anything."""
    sizes: dict[int, int] = {}

    def size(current: yaml.Node, depth: int) -> int:
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{where}:{current.start_mark.line + 1}: nested deeper than {MAX_CONFIG_DEPTH} levels")
        known = sizes.get(id(current))
        if known is not None:
            return known
        total = 1
        if isinstance(current, yaml.SequenceNode):
            total += sum(size(child, depth + 1) for child in current.value)
        elif isinstance(current, yaml.MappingNode):
            total += sum(size(key, depth + 1) + size(value, depth + 1) for key, value in current.value)
        if total > MAX_CONFIG_NODES:
            raise ConfigError(f"{where}:{current.start_mark.line + 1}: the config expands to more than "
                              f"{MAX_CONFIG_NODES} values (aliases counted as often as they are used)")
        sizes[id(current)] = total
        return total

    size(node, 0)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path`` as Python values (None for an empty file)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: a config of {len(raw)} bytes is larger than the {MAX_CONFIG_BYTES} allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not a YAML text file (byte {exc.start} is not UTF-8)") from None
    try:
        loader = _ConfigLoader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                _check_size(node, str(path))
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply to read") from None
    return data
