"""Hypothesis strategies read off a msgspec schema: documents that conform to it, and documents
with one thing wrong at any field path.

The oracle is :func:`conforms`, written here from the schema's type info (``msgspec.inspect``),
not from msgspec's decoder: a value "differs from the schema" when it is of another type (no
string or float for an integer, no ``true`` for a number, no ``null`` where a map is required),
out of its range, over (or under) its length, off its pattern, another literal, or a map missing
a required field or carrying one its type forbids. Cross-field rules (``tp_rank`` below
``tp_size``...) are each schema's own; :data:`FIXUPS` makes generated documents keep them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import msgspec.inspect as mi
from hypothesis import assume
from hypothesis import strategies as st

#: Struct class name -> what makes a document that conforms field by field keep the Struct's
#: cross-field rules too (its ``__post_init__``).
FIXUPS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {}
#: Struct class name -> fields whose valid values are fixed (a hello's version must be the
#: reader's: any other in range is refused after the schema).
FIXED: dict[str, dict[str, Any]] = {}
#: Longest list or map a valid document gets (the bounds are tested by their own violations).
SMALL = 3
#: The protocol's policy on unknown fields, stated here rather than read off the schema (so a
#: Struct that stopped refusing them fails): refused everywhere but in these Structs (the
#: hello's top level, where ``doctor --json`` adds ``diagnostics``).
IGNORES_UNKNOWN = frozenset({"HelloDoc"})

#: Values of every kind: a violation at a field is one of these its type does not admit, or a
#: value just past a bound.
POOL: tuple[Any, ...] = (
    0,
    1,
    -1,
    1.5,
    10.0,
    float("nan"),
    float("inf"),
    True,
    False,
    None,
    "",
    "x",
    "10",
    b"",
    b"x",
    [],
    [1],
    {},
    {"a": 1},
    2**64 - 1,
    -(2**63),
)


def unwrap(t: mi.Type) -> mi.Type:
    while isinstance(t, mi.Metadata):
        t = t.type
    return t


def _int_bounds(t: mi.IntType) -> tuple[int | None, int | None]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
    return lo, hi


def conforms(value: Any, t: mi.Type) -> bool:
    """Whether ``value`` (a decoded document: dicts, lists, scalars) is what ``t`` describes."""
    t = unwrap(t)
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.IntType):
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        lo, hi = _int_bounds(t)
        return (lo is None or value >= lo) and (hi is None or value <= hi)
    if isinstance(t, mi.FloatType):
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
        x = float(value) if not isinstance(value, int) or abs(value) < 2**1000 else math.inf
        return (
            not math.isnan(x)
            and (t.ge is None or x >= t.ge)
            and (t.le is None or x <= t.le)
            and (t.gt is None or x > t.gt)
            and (t.lt is None or x < t.lt)
        )
    if isinstance(t, mi.StrType | mi.BytesType):
        if not isinstance(value, str if isinstance(t, mi.StrType) else bytes):
            return False
        if t.max_length is not None and len(value) > t.max_length:
            return False
        if t.min_length is not None and len(value) < t.min_length:
            return False
        return not (isinstance(t, mi.StrType) and t.pattern and re.search(t.pattern, value) is None)
    if isinstance(t, mi.LiteralType):
        return any(type(value) is type(v) and value == v for v in t.values)
    if isinstance(t, mi.ListType | mi.VarTupleType):
        return (
            isinstance(value, list)
            and (t.max_length is None or len(value) <= t.max_length)
            and (t.min_length is None or len(value) >= t.min_length)
            and all(conforms(x, t.item_type) for x in value)
        )
    if isinstance(t, mi.DictType):
        return (
            isinstance(value, dict)
            and (t.max_length is None or len(value) <= t.max_length)
            and all(conforms(k, t.key_type) and conforms(v, t.value_type) for k, v in value.items())
        )
    if isinstance(t, mi.UnionType):
        return any(conforms(value, x) for x in t.types)
    if isinstance(t, mi.StructType):
        if not isinstance(value, dict):
            return False
        names = {f.encode_name for f in t.fields} | ({t.tag_field} if t.tag_field else set())
        if t.tag_field and value.get(t.tag_field) != t.tag:
            return False
        if t.cls.__name__ not in IGNORES_UNKNOWN and not set(value) <= names:
            return False
        for f in t.fields:
            if f.encode_name in value:
                if not conforms(value[f.encode_name], f.type):
                    return False
            elif f.required:
                return False
        return True
    raise TypeError(f"no oracle for {t!r}")


#: Strategies built once per type (building them is most of a draw's cost otherwise).
_VALID: dict[int, tuple[mi.Type, st.SearchStrategy[Any]]] = {}


def valid(t: mi.Type) -> st.SearchStrategy[Any]:
    """Documents that conform to ``t`` (every field given, lists and maps short)."""
    t = unwrap(t)
    if id(t) not in _VALID:
        _VALID[id(t)] = (t, _valid(t))  # the type is kept: its id stays its own
    return _VALID[id(t)][1]


def _valid(t: mi.Type) -> st.SearchStrategy[Any]:
    if isinstance(t, mi.AnyType):
        return st.one_of(st.none(), st.integers(0, 9), st.binary(max_size=16))
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.IntType):
        lo, hi = _int_bounds(t)
        return st.integers(lo, hi)
    if isinstance(t, mi.FloatType):
        return st.floats(t.ge, t.le, allow_nan=False, allow_infinity=False)
    if isinstance(t, mi.StrType):
        if t.pattern:
            return st.from_regex(t.pattern, fullmatch=True).filter(lambda s, n=t.max_length: n is None or len(s) <= n)
        return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or 12, 12))
    if isinstance(t, mi.BytesType):
        return st.binary(min_size=t.min_length or 0, max_size=max(t.min_length or 0, 16))
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.ListType | mi.VarTupleType):
        return st.lists(valid(t.item_type), min_size=t.min_length or 0, max_size=min(t.max_length or SMALL, SMALL))
    if isinstance(t, mi.DictType):
        return st.dictionaries(valid(t.key_type), valid(t.value_type), max_size=min(t.max_length or SMALL, SMALL))
    if isinstance(t, mi.UnionType):
        return st.one_of(*(valid(x) for x in t.types))
    if isinstance(t, mi.StructType):
        return _valid_struct(t)
    raise TypeError(f"no strategy for {t!r}")


def _valid_struct(t: mi.StructType) -> st.SearchStrategy[dict[str, Any]]:
    fixed = FIXED.get(t.cls.__name__, {})
    fields = {f.encode_name: st.just(fixed[f.name]) if f.name in fixed else valid(f.type) for f in t.fields}
    head = {t.tag_field: st.just(t.tag)} if t.tag_field else {}
    fixup = FIXUPS.get(t.cls.__name__, lambda d: d)
    return st.fixed_dictionaries({**head, **fields}).map(fixup)


# --- one thing wrong ------------------------------------------------------------------------------


def nodes(
    doc: Any, t: mi.Type, path: tuple[Any, ...] = (), outer: mi.Type | None = None
) -> list[tuple[tuple[Any, ...], mi.Type, mi.Type]]:
    """Every node of ``doc``: its path, its type, and the type its value must have there (the
    union, for the branch of a union it took); nothing under an ``Any``."""
    t = unwrap(t)
    out = [(path, t, outer or t)]
    if isinstance(t, mi.UnionType):
        # The branch the value took (the one it conforms to), at the same path: a value of
        # no branch breaks the union, a map missing a field breaks its branch.
        for x in t.types:
            if conforms(doc, x):
                return [*out, *nodes(doc, x, path, t)]
        return out
    if isinstance(t, mi.StructType) and isinstance(doc, dict):
        for f in t.fields:
            if f.encode_name in doc:
                out += nodes(doc[f.encode_name], f.type, (*path, f.encode_name))
    elif isinstance(t, mi.ListType | mi.VarTupleType) and isinstance(doc, list):
        for i, x in enumerate(doc):
            out += nodes(x, t.item_type, (*path, i))
    elif isinstance(t, mi.DictType) and isinstance(doc, dict):
        for k, v in doc.items():
            out += nodes(v, t.value_type, (*path, k))
    return out


def _past_bounds(t: mi.Type, example: Any) -> list[Any]:
    """Values just past ``t``'s bounds (some may still conform: the caller filters)."""
    t = unwrap(t)
    if isinstance(t, mi.IntType):
        lo, hi = _int_bounds(t)
        return [
            x for x in ((lo - 1) if lo is not None else None, (hi + 1) if hi is not None else None) if x is not None
        ]
    if isinstance(t, mi.FloatType):
        below = [t.ge - abs(t.ge) * 1e-3 - 1e-9] if t.ge is not None else []
        return below + ([t.le * 1.001 + 1e-9] if t.le is not None else [])
    if isinstance(t, mi.StrType):
        out: list[Any] = ["x" * (t.max_length + 1)] if t.max_length is not None else []
        if t.pattern:
            out += ["!", " ", "host ", "cuda:", "A"]
        return out
    if isinstance(t, mi.BytesType):
        out = [b"\0" * (t.max_length + 1)] if t.max_length is not None else []
        return out + ([b"\0" * (t.min_length - 1)] if t.min_length else [])
    if isinstance(t, mi.LiteralType):
        return ["other", *(str(v).upper() for v in t.values)]
    if isinstance(t, mi.ListType | mi.VarTupleType) and t.max_length is not None and isinstance(example, list):
        item = example[0] if example else None
        return [[item] * (t.max_length + 1)] if item is not None else []
    if isinstance(t, mi.DictType) and t.max_length is not None and isinstance(example, dict) and example:
        value = next(iter(example.values()))
        return [{f"k{i}": value for i in range(t.max_length + 1)}]
    return []


def _replaced(doc: Any, path: tuple[Any, ...], value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    out: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    if delete and not rest:
        del out[head]
    else:
        out[head] = _replaced(doc[head], rest, value, delete) if rest else value
    return out


class Schema:
    """A schema's type info under a short name (what hypothesis prints of a strategy's arguments)."""

    def __init__(self, name: str, t: Any) -> None:
        self.name = name
        self.type: mi.Type = t if isinstance(t, mi.Type) else mi.type_info(t)

    def __repr__(self) -> str:
        return self.name


@st.composite
def one_wrong(draw: st.DrawFn, schema: Schema) -> tuple[dict[str, Any], str]:
    """A document conforming to ``schema`` but at one path (any depth), with what was done there."""
    t = schema.type
    doc = draw(valid(t))
    # Under an ``Any`` everything conforms: nothing to break there.
    path, node, outer = draw(st.sampled_from([n for n in nodes(doc, t) if not isinstance(n[1], mi.AnyType)]))
    here: Any = doc
    for p in path:
        here = here[p]
    # Kinds of violation first, then one of that kind: the few structural ones (a field
    # missing, one too many) are drawn as often as all the wrong values together.
    kinds: dict[str, list[Any]] = {
        "wrong value": [v for v in POOL if not conforms(v, outer)],  # a value the type admits is none
        "past a bound": [v for v in _past_bounds(node, here) if not conforms(v, outer)],
    }
    if isinstance(node, mi.StructType) and isinstance(here, dict):
        kinds["missing"] = [f.encode_name for f in node.fields if f.required and f.encode_name in here]
        if node.tag_field:
            kinds["missing"].append(node.tag_field)
            kinds["wrong tag"] = ["no-such-kind"]
        if node.cls.__name__ not in IGNORES_UNKNOWN:
            kinds["extra"] = ["unexpected_field"]
    if isinstance(node, mi.DictType) and isinstance(here, dict):
        key = unwrap(node.key_type)
        if isinstance(key, mi.StrType) and key.max_length is not None and here:
            kinds["long key"] = ["k" * (key.max_length + 1)]
    how = draw(st.sampled_from(sorted(k for k, v in kinds.items() if v)))
    value = draw(st.sampled_from(kinds[how]))
    if how == "past a bound":
        how = "wrong value"
    if how == "wrong value":
        wrong, what = _replaced(doc, path, value), f"{how} {value!r:.40} at {path}"
    elif how == "missing":
        wrong, what = _replaced(doc, (*path, value), None, delete=True), f"{value} missing at {path}"
    elif how == "wrong tag":
        wrong, what = _replaced(doc, (*path, node.tag_field), value), f"type {value!r} at {path}"
    elif how == "extra":
        wrong, what = _replaced(doc, (*path, value), 0), f"extra field at {path}"
    else:
        entries = dict(here)
        entries[value] = next(iter(here.values()))
        wrong, what = _replaced(doc, path, entries), f"over-long key at {path}"
    there: Any = wrong
    for p in path:
        there = there[p]
    assume(not conforms(there, outer))  # what is wrong for a branch may be another branch
    return wrong, what
