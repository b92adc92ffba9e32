"""``tlt train --help-config`` and docs/configuration.md: every key with its type, default and docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path
from typing import Any

from megatron_tlt.config.run import TLTConfig


def field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field -> its docstring: the string literal after each field, which Python drops at
    run time, so it is read from the section modules' syntax trees."""
    docs: dict[str, dict[str, str]] = {}
    nodes = [node for path in sorted(Path(__file__).parent.glob("*.py"))
             for node in ast.parse(path.read_text(encoding="utf-8")).body]
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for statement, following in zip(node.body, node.body[1:]):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                fields[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def as_yaml(value: Any) -> str:
    """A default as a user writes it in YAML or a key=value override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(as_yaml(v) for v in value)}]"
    return str(value)


def value_text(ran: Any, default: Any) -> str:
    """What ``tlt train`` runs for a key, and the field's own default where the tiny config sets another."""
    if ran == default:
        return f"`tlt train`: {as_yaml(ran)}"
    return f"`tlt train`: {as_yaml(ran)}; field default {as_yaml(default)}"


def sections_run(ran: Any = None, defaults: Any = None, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, the section ``tlt train`` runs, the same section at its field defaults), in the tree's order:
    a section, then the sections nested in it. ``tlt train`` runs launch/configs/tiny.yaml."""
    if ran is None:
        from megatron_tlt.config.loading import DEFAULT_CONFIG, load_config

        ran, defaults = load_config(DEFAULT_CONFIG), TLTConfig()
    found = [(prefix, ran, defaults)] if prefix else []
    for field in dataclasses.fields(ran):
        value = getattr(ran, field.name)
        if dataclasses.is_dataclass(value):
            found += sections_run(value, getattr(defaults, field.name), f"{prefix}{field.name}.")
    return [(name.rstrip("."), r, d) for name, r, d in found]


def describe_keys() -> str:
    """Every config key with its type, what ``tlt train`` runs (its field default where tiny.yaml sets another) and
    its docstring, grouped by section (``tlt train --help-config``)."""
    docs = field_docs()
    lines = ["Config keys of `tlt train`: set them in a YAML file (--config NAME|PATH) or as key=value overrides.",
             "Values are what `tlt train` runs (launch/configs/tiny.yaml), with the field default where it differs."]
    for name, ran, defaults in sections_run():
        doc = inspect.cleandoc(type(ran).__doc__ or "").split("\n\n")[0]
        lines += ["", f"{name}: {' '.join(doc.split())}"]
        for field in dataclasses.fields(ran):
            value = getattr(ran, field.name)
            if dataclasses.is_dataclass(value):
                continue
            lines.append(f"  {name}.{field.name} ({field.type}; {value_text(value, getattr(defaults, field.name))})")
            text = " ".join(docs.get(type(ran).__name__, {}).get(field.name, "").split())
            if text:
                lines += textwrap.wrap(text, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                       break_on_hyphens=False)
    return "\n".join(lines)
