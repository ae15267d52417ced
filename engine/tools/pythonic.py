"""The pythonic tool-call format (Gemma 3 as Google's function-calling guide prompts it, and
vLLM's `pythonic` parser): a reply that is a Python list of calls,
`[get_weather(city="Paris"), get_time(zone="CET")]`. Values are Python literals; JSON's
true / false / null are read too, since a constrained reply writes its values as JSON."""

from __future__ import annotations

import ast
import json

from engine.tools.base import (
    Parsed,
    PartialCall,
    TokenId,
    ToolParser,
    compact,
    function_schema,
    ordered_pairs,
)

_JSON_NAMES = {"true": True, "false": False, "null": None}


class Pythonic(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.strip()
        if not body.startswith("["):
            return Parsed(text if (final or body) else "", [])
        if not body.endswith("]"):  # not closed yet: nothing is settled
            return Parsed(None, [] if not final else self._cut(body))
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return Parsed(None, [] if not final else self._cut(body))
        if not isinstance(tree, ast.List) or not all(
                isinstance(e, ast.Call) and isinstance(e.func, ast.Name) for e in tree.elts):
            return Parsed(text, [])
        return Parsed(None, [self._call(e) for e in tree.elts])

    def _cut(self, body: str) -> list[PartialCall]:
        """A reply that ended inside its list: the calls complete up to there."""
        for end in range(len(body), 0, -1):
            if body[end - 1] == ")":
                parsed = self.parse(body[:end] + "]", final=False)
                if parsed.calls:
                    return parsed.calls
        return []

    @staticmethod
    def _call(node: ast.Call) -> PartialCall:
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg}
        except ValueError:
            return PartialCall(node.func.id, "", False)
        return PartialCall(node.func.id, json.dumps(args, ensure_ascii=False), True)

    def grammar(self, tools: list[dict], parallel: bool, token_id: TokenId) -> str:
        rules, names = [], []
        for t, tool in enumerate(tools):
            schema = function_schema(tool)
            props = schema.get("properties") or {}
            required = set(schema.get("required") or [])
            items = sorted(props, key=lambda k: k not in required)  # required ones first
            for i, k in enumerate(items):
                rules.append(f"v{t}_{i}: %json {json.dumps(compact(props[k]))}")
            pairs = [(f'"{k}=" v{t}_{i}', k in required) for i, k in enumerate(items)]
            args = ordered_pairs(pairs, '", "')
            rules.append(f'call{t}: {json.dumps(tool["function"]["name"] + "(")} {args} ")"')
            names.append(f"call{t}")
        call = " | ".join(names)
        start = 'start: "[" call ("," " "? call)* "]"' if parallel else 'start: "[" call "]"'
        return "\n".join([start, f"call: {call}", *rules]) + "\n"


def _literal(node: ast.expr):
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)


PYTHONIC = Pythonic()
