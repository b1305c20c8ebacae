"""Which outside symbols the App's Swift sources use, by name: the check behind `_meta/mlx_symbols.yaml`.

Names are collected with tree-sitter-swift: type names, members after a dot, called functions and argument
labels. Names the generated sources declare themselves (App and Core) are removed; what is left must be on the
platform list (Swift, Foundation, SwiftUI, Darwin, os) or on the MLX symbol list, checked against a pinned
version. The check is by name, so a new MLX call cannot slip in unseen, though a name the project also
declares would hide an MLX use of the same name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolchain.exceptions import SchemaError

_TYPE_DECLARATIONS = {"class_declaration", "protocol_declaration", "typealias_declaration"}
_MEMBER_SCOPES = {"class_body", "source_file", "protocol_body", "enum_class_body"}
_PARAMETERS = {"parameter", "lambda_parameter", "tuple_type_item"}
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class SymbolEntry:
    symbol: str
    module: str
    verified_against: str
    source: str

    @property
    def names(self) -> set[str]:
        return set(_IDENT.findall(self.symbol))


def _parser():  # type: ignore[no-untyped-def]
    import tree_sitter
    import tree_sitter_swift

    return tree_sitter.Parser(tree_sitter.Language(tree_sitter_swift.language()))


def _walk(node):  # type: ignore[no-untyped-def]
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(current.children))


def _text(node, source: bytes) -> str:  # type: ignore[no-untyped-def]
    return source[node.start_byte : node.end_byte].decode()


@dataclass
class Names:
    """Names in Swift sources, by role: what is used from elsewhere and what the sources declare."""

    types: set[str] = field(default_factory=set)
    members: set[str] = field(default_factory=set)
    labels: set[str] = field(default_factory=set)
    calls: set[str] = field(default_factory=set)
    declared_types: set[str] = field(default_factory=set)
    declared_members: set[str] = field(default_factory=set)
    declared_locals: set[str] = field(default_factory=set)
    imports: set[str] = field(default_factory=set)

    def update(self, other: Names) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).update(getattr(other, name))

    def outside(self, own: Names) -> set[str]:
        """Used names that nothing in `own` (the project's declarations) accounts for."""
        members = own.declared_members | own.declared_types
        values = members | own.declared_locals
        return (
            (self.types - own.declared_types)
            | (self.members - members)
            | (self.labels - values)
            | (self.calls - values)
        )


def _is_override(declaration) -> bool:  # type: ignore[no-untyped-def]
    return any(c.type == "modifiers" and b"override" in c.text for c in declaration.children)


def collect_names(source: bytes) -> Names:
    tree = _parser().parse(source)
    names = Names()
    for node in _walk(tree.root_node):
        if node.type == "import_declaration":
            names.imports.add(_text(node, source).split()[-1])
            continue
        if node.type not in ("simple_identifier", "type_identifier"):
            continue
        parent = node.parent
        if parent is None or parent.type == "identifier":
            continue
        name = _text(node, source)
        if parent.type in _TYPE_DECLARATIONS and node.type == "type_identifier":
            names.declared_types.add(name)
        elif parent.type == "function_declaration" or (
            parent.type == "pattern" and parent.parent is not None and parent.parent.type == "property_declaration"
        ):
            declaration = parent if parent.type == "function_declaration" else parent.parent
            if _is_override(declaration):
                # Overriding an MLX class's member is a use of that member.
                names.members.add(name)
            elif declaration.parent is not None and declaration.parent.type in _MEMBER_SCOPES:
                names.declared_members.add(name)
            else:
                names.declared_locals.add(name)
        elif parent.type == "enum_entry":
            names.declared_members.add(name)
        elif parent.type in _PARAMETERS or parent.type == "pattern":
            names.declared_locals.add(name)
        elif node.type == "type_identifier" or (
            # `Memory.cacheLimit`, `MLXFast.rmsNorm(...)`: a capitalised head of a member access is a type.
            parent.type == "navigation_expression" and parent.children[0] == node and name[:1].isupper()
        ):
            names.types.add(name)
        elif parent.type == "navigation_suffix":
            names.members.add(name)
        elif parent.type == "value_argument_label":
            names.labels.add(name)
        elif parent.type == "call_expression":
            names.calls.add(name)
    return names


def collect_files(files: Iterable[Path]) -> Names:
    names = Names()
    for path in files:
        names.update(collect_names(path.read_bytes()))
    return names


def load_symbol_list(path: Path) -> list[SymbolEntry]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("symbols"), list):
        raise SchemaError("expected a mapping with a 'symbols' list", file=path, field="symbols")
    entries = []
    for i, item in enumerate(data["symbols"]):
        missing = [k for k in ("symbol", "module", "verified_against", "source") if not item.get(k)]
        if missing:
            raise SchemaError(f"missing {', '.join(missing)}", file=path, field=f"symbols.{i}")
        entries.append(SymbolEntry(item["symbol"], item["module"], item["verified_against"], item["source"]))
    return entries


def load_platform_names(path: Path) -> set[str]:
    names: set[str] = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.update(line.split())
    return names


def unlisted_symbols(
    app_sources: Iterable[Path], own_sources: Iterable[Path], symbols: list[SymbolEntry], platform: set[str]
) -> dict[str, list[str]]:
    """Names the App uses that are neither declared by the project nor listed; name -> files using it."""
    own = collect_files(own_sources)
    listed = set().union(*(e.names for e in symbols)) if symbols else set()
    unknown: dict[str, list[str]] = {}
    for path in app_sources:
        for name in sorted(collect_names(path.read_bytes()).outside(own) - listed - platform):
            unknown.setdefault(name, []).append(path.name)
    return unknown
