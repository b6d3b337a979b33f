"""YAML configs for every job: one typed pydantic model per job, ``--set key.path=value`` overrides,
and errors that name the bad key. Unknown keys are errors (models are ``extra="forbid"``)."""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class StrictConfig(BaseModel):
    """Base of every job config: unknown keys are errors; field docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c=value`` in a nested dict (creating levels; an integer part indexes a list, as in
    ``models.0.name``), so the model reports bad keys later."""
    *parents, leaf = dotted.split(".")
    node: Any = tree
    for part in parents:
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ValueError(f"--set {dotted}: {part!r} is not an index of a {len(node)}-item list")
            child = node[int(part)]
        else:
            child = node.setdefault(part, {})
        if not isinstance(child, (dict, list)):
            raise ValueError(f"--set {dotted}: {part!r} is not a section")
        node = child
    if isinstance(node, list):
        if not leaf.isdigit() or int(leaf) >= len(node):
            raise ValueError(f"--set {dotted}: {leaf!r} is not an index of a {len(node)}-item list")
        node[int(leaf)] = value
    else:
        node[leaf] = value


def _explain(err: ValidationError, what: str) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "<config>"
        lines.append(f"{where}: unknown key" if item["type"] == "extra_forbidden" else f"{where}: {item['msg']}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def parse_config(model: type[M], tree: dict[str, Any], overrides: list[str] = (), what: str = "config") -> M:
    """Validate ``tree`` as ``model`` after applying ``key.path=value`` overrides (values parsed as YAML)."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ValueError(f"--set {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
        _set_dotted(tree, key.strip(), value)
    try:
        return model.model_validate(tree)
    except ValidationError as err:
        raise ValueError(_explain(err, what)) from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    tree = yaml.safe_load(path.read_text()) or {}
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: the config must be a YAML mapping")
    return tree


def load_config(model: type[M], path: str | Path, overrides: list[str] = (), what: str = "config") -> M:
    """Read a YAML file, apply ``--set`` overrides and validate it as ``model``."""
    return parse_config(model, read_yaml_mapping(path), overrides, what)


def job_main(
    prog: str,
    description: str,
    model: type[M],
    run: Callable[[M], object],
    argv: list[str] | None = None,
    what: str = "config",
    config_help: str = "YAML config",
    config_required: bool = False,
) -> int:
    """The command line of a config-driven job: ``--config FILE`` (without it, every field's default,
    unless ``config_required``) and repeatable ``--set key=value``; bad input is one
    ``prog: error: ...`` line and exit code 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", help=config_help)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a config key, dotted for nested keys (e.g. train.max_steps=10); values are YAML; repeatable",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.config is not None:
            cfg = load_config(model, args.config, args.set, what)
        elif config_required:
            raise ValueError(f"--config is required ({config_help})")
        else:
            cfg = parse_config(model, {}, args.set, what)
        run(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    return 0
