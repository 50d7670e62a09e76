"""The schema tables of docs/hello.md and docs/wire.md, rendered from the msgspec Structs.

Each table is written between ``<!-- schema:NAME -->`` and ``<!-- /schema:NAME -->`` in its
document; ``python -m kvtransport.tools.schema_doc`` rewrites them, ``--check`` says whether
any is stale (``tests/test_schema.py`` checks it too, so the docs cannot drift from the code).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from kvtransport.negotiation.schema import DecisionDoc, HelloDoc, RegionsDoc
from kvtransport.runtime.wire import TYPES
from kvtransport.staging.notices import KINDS as NOTICE_KINDS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _unwrap(t: mi.Type) -> tuple[mi.Type, str]:
    """A field's type without its metadata, and its description."""
    description = ""
    while isinstance(t, mi.Metadata):
        description = (t.extra_json_schema or {}).get("description", description)
        t = t.type
    return t, description


def _range(t: mi.IntType | mi.FloatType) -> str:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    if lo is not None and lo == hi:
        return f" = {lo}"
    if lo is None and hi is None:
        return ""
    return f" in [{_number(lo)}, {_number(hi)}]"


def _number(x: float | None) -> str:
    if x is None:
        return "..."
    if isinstance(x, int) and x < 0:
        return "-" + _number(-x).replace("2**62-1", "(2**62-1)")
    if isinstance(x, int) and x >= 1 << 16:
        exact = x + 1 if (x + 1) & x == 0 else x  # 2**n - 1 reads as 2**n-1
        power = exact.bit_length() - 1
        if exact == 1 << power:
            return f"2**{power}" + ("-1" if exact != x else "")
    return f"{x:g}" if isinstance(x, float) else str(x)


def _length(t: Any, unit: str) -> str:
    lo, hi = t.min_length, t.max_length
    if lo and hi:
        return f" ({lo} to {hi:,} {unit})"
    if hi is not None:
        return f" (at most {hi:,} {unit})"
    if lo:
        return f" (at least {lo} {unit})"
    return ""


def describe(t: mi.Type, name_of: Callable[[type], str]) -> str:
    """A type in words: ``integer in [0, 2**62-1]``, ``text, at most 64 characters``..."""
    t, _ = _unwrap(t)
    if isinstance(t, mi.IntType):
        return "integer" + _range(t)
    if isinstance(t, mi.FloatType):
        return "number" + _range(t)
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, mi.NoneType):
        return "`null`"
    if isinstance(t, mi.AnyType):
        return "anything"
    if isinstance(t, mi.StrType):
        if t.pattern:
            return f"text matching `{t.pattern}`"
        return "text" + _length(t, "characters")
    if isinstance(t, mi.BytesType):
        return "bytes" + _length(t, "bytes")
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{json.dumps(v)}`" for v in t.values)
    if isinstance(t, mi.ListType | mi.VarTupleType):
        return f"list of {describe(t.item_type, name_of)}" + _length(t, "entries")
    if isinstance(t, mi.DictType):
        return f"map of {describe(t.key_type, name_of)} to {describe(t.value_type, name_of)}" + _length(t, "entries")
    if isinstance(t, mi.UnionType):
        return " or ".join(describe(x, name_of) for x in t.types)
    if isinstance(t, mi.StructType):
        return name_of(t.cls)
    raise TypeError(f"no words for {t!r}")


def _default(field: mi.Field) -> str:
    if field.required:
        return "required"
    value = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    return "`" + msgspec.json.encode(value).decode() + "`"


def _structs(t: mi.Type) -> Iterator[tuple[str, type]]:
    """The Structs a type refers to, with the path suffix that reaches them."""
    t, _ = _unwrap(t)
    if isinstance(t, mi.StructType):
        yield "", t.cls
    elif isinstance(t, mi.ListType | mi.VarTupleType):
        yield from (("[]" + p, c) for p, c in _structs(t.item_type))
    elif isinstance(t, mi.DictType):
        yield from ((".<name>" + p, c) for p, c in _structs(t.value_type))
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            yield from _structs(x)


def _table(cls: type, name_of: Callable[[type], str], skip: frozenset[str] = frozenset()) -> list[str]:
    """A Struct's fields: type and bounds, default (or required), meaning."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in info.fields:
        if f.encode_name in skip:
            continue
        _, meaning = _unwrap(f.type)
        cells = (f"`{f.encode_name}`", describe(f.type, name_of), _default(f), meaning)
        # A table cell ends at any "|", in code spans too (regular expressions, unions).
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return rows


def _doc(cls: type) -> str:
    """A Struct's docstring as one paragraph of markdown."""
    return " ".join((cls.__doc__ or "").split()).replace("``", "`")


def render_tree(root: type, root_path: str) -> str:
    """``root``'s table, then one per Struct it reaches, headed by every path that reaches it."""
    paths: dict[type, list[str]] = {root: [root_path]}
    order = [root]
    for cls in order:  # grows while iterating: breadth first
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        for f in info.fields:
            for suffix, sub in _structs(f.type):
                path = f"{paths[cls][0]}.{f.encode_name}{suffix}".lstrip(".")
                if sub not in paths:
                    paths[sub] = []
                    order.append(sub)
                paths[sub].append(path)

    def heading(cls: type) -> str:
        return ", ".join(f"`{p}`" for p in paths[cls]) if paths[cls] != [""] else "top level"

    def name_of(cls: type) -> str:
        return f"map ({heading(cls)})"

    out: list[str] = []
    for cls in order:
        out += [f"**{heading(cls)}**: {_doc(cls)}", "", *_table(cls, name_of), ""]
    return "\n".join(out).rstrip() + "\n"


def render_messages() -> str:
    """One table per control message type (``t`` and ``v`` are every message's)."""
    out: list[str] = []
    for kind, cls in TYPES.items():
        out += [f"**`{kind}`**: {_doc(cls)}", "", *_table(cls, _no_struct, frozenset({"v"})), ""]
    return "\n".join(out).rstrip() + "\n"


def render_notices() -> str:
    out: list[str] = []
    for cls in NOTICE_KINDS:
        kind = cls.__struct_config__.tag
        out += [f"**`{kind}`**: {_doc(cls)}", "", *_table(cls, _no_struct), ""]
    return "\n".join(out).rstrip() + "\n"


def _no_struct(cls: type) -> str:
    raise TypeError(f"{cls.__name__}: a message field is a document or a scalar, not a Struct")


#: Each generated block: (document, name) -> what renders it.
BLOCKS: dict[tuple[str, str], Callable[[], str]] = {
    ("hello.md", "hello"): lambda: render_tree(HelloDoc, ""),
    ("wire.md", "messages"): render_messages,
    ("wire.md", "regions"): lambda: render_tree(RegionsDoc, "regions"),
    ("wire.md", "decision"): lambda: render_tree(DecisionDoc, "decision"),
    ("wire.md", "notices"): render_notices,
}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- schema:{name} -->\n)(.*?)(<!-- /schema:{name} -->)", re.DOTALL)


def stale(docs: Path = DOCS) -> list[str]:
    """The blocks whose text differs from what the code renders (empty: the docs are current)."""
    out = []
    for (doc, name), render in BLOCKS.items():
        match = _block(name).search((docs / doc).read_text())
        if match is None or match.group(2) != render():
            out.append(f"{doc}: {name}")
    return out


def write(docs: Path = DOCS) -> None:
    for (doc, name), render in BLOCKS.items():
        path = docs / doc
        text = path.read_text()
        table = render()

        def put(m: re.Match[str], table: str = table) -> str:
            return m.group(1) + table + m.group(3)

        new, n = _block(name).subn(put, text)
        if n != 1:
            raise SystemExit(f"{path}: no <!-- schema:{name} --> block (or more than one)")
        path.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale, write nothing")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for line in bad:
            print(f"stale: {line}", file=sys.stderr)
        return 1 if bad else 0
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
