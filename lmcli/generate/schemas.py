"""Whether a JSON schema can be satisfied at all: a ``$ref`` that recurses without end
(``{"$ref": "#"}``, two ``$defs`` that refer to each other, an object that requires a property of
its own schema) admits no finite JSON value. The grammar compiler takes such a schema and fails
only while decoding (its parser's state in the message); ``no_finite_value`` says so up front.

The check is the least fixed point of "has a finite value" over the schemas that ``$ref``s name:
a schema has one when its ``allOf`` all do, one of its ``anyOf`` (``oneOf``) does, and one of its
types does: an object when each of its required properties does, an array when its first
``minItems`` items do. What it cannot judge (a remote ``$ref``, ``not``, ``if``, a required
property no ``properties`` declares) counts as satisfiable: it refuses only what it proves empty.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

MAX_DEPTH = 200  # nesting judged; deeper counts as satisfiable (the compiler bounds nesting)
MAX_ROUNDS = 64  # rounds of the fixed point; past them the schema counts as satisfiable
MAX_VISITS = 200_000  # subschemas judged in all, a bound on the work of a crafted schema


def resolve(root: Any, ref: Any) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/name``) names in ``root``; None for any
    other reference, or a pointer that names nothing."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


class _Judge:
    """One round of the fixed point: which schemas have a finite value, given the ``$ref``
    targets already known to (``finite``, by id)."""

    def __init__(self, root: Any, finite: set[int], targets: dict[int, tuple[str, Any]]) -> None:
        self.root, self.finite, self.targets = root, finite, targets
        self.met = list(targets)  # the targets' ids, in the order met
        self.memo: dict[int, bool] = {}
        self.visits = 0

    def has_value(self, schema: Any, depth: int = 0) -> bool:
        if schema is False:
            return False
        if not isinstance(schema, dict) or depth > MAX_DEPTH:
            return True
        if id(schema) not in self.memo:
            self.visits += 1
            self.memo[id(schema)] = self._judge(schema, depth + 1)
        return self.memo[id(schema)]

    def _judge(self, schema: dict[str, Any], depth: int) -> bool:
        ref = schema.get("$ref")
        if ref is not None:
            target = resolve(self.root, ref)
            if target is not None:
                if id(target) not in self.targets:
                    self.targets[id(target)] = (ref, target)
                    self.met.append(id(target))
                if id(target) not in self.finite:
                    return False
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and not all(self.has_value(s, depth) for s in all_of):
            return False
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options and not any(self.has_value(s, depth) for s in options):
                return False
        if "const" in schema or "enum" in schema:
            return True
        types = schema.get("type")
        if not isinstance(types, str | list) or not types:
            return True  # any type: a number has no parts
        return any(
            self._type_has_value(schema, t, depth) for t in ([types] if isinstance(types, str) else types)
        )

    def _type_has_value(self, schema: dict[str, Any], kind: Any, depth: int) -> bool:
        if kind == "object":
            properties, required = schema.get("properties"), schema.get("required")
            if not isinstance(properties, dict) or not isinstance(required, list):
                return True
            return all(self.has_value(properties[n], depth) for n in required if n in properties)
        if kind == "array":
            need = schema.get("minItems", 0)
            items = schema.get("items", True)
            prefix = schema.get("prefixItems", items if isinstance(items, list) else [])
            rest = schema.get("additionalItems", True) if isinstance(items, list) else items
            if type(need) is not int or not isinstance(prefix, list):
                return True
            firsts = prefix[:need]
            return all(self.has_value(s, depth) for s in firsts) and (
                need <= len(prefix) or self.has_value(rest, depth)
            )
        return True


def no_finite_value(schema: Any, root: Any = None) -> str | None:
    """Why no finite JSON value satisfies ``schema`` (its ``$ref``s resolved in ``root``, by
    default the schema itself), or None when one may."""
    root = schema if root is None else root
    finite: set[int] = set()  # ids of the $ref targets known to have a finite value
    targets: dict[int, tuple[str, Any]] = {}  # every $ref target met: id -> (the ref, the schema)
    visits = 0
    for _ in range(MAX_ROUNDS):
        known = len(targets)
        judge = _Judge(root, finite, targets)
        if judge.has_value(schema):
            return None
        grown: set[int] = set()
        for key in judge.met:  # grows as judging a target meets others: they are judged too
            if key not in finite and judge.has_value(targets[key][1]):
                grown.add(key)
        visits += judge.visits
        if visits > MAX_VISITS:
            return None
        if not grown and len(targets) == known:  # settled: nothing more can be shown finite
            endless = next((ref for key, (ref, _) in targets.items() if key not in finite), None)
            if endless is None:
                return "no JSON value satisfies it"
            return f"no finite JSON value satisfies it ($ref {endless!r} recurses without end)"
        finite |= grown
    return None
