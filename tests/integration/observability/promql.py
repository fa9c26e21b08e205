"""The PromQL the observability files hold: every dashboard panel's queries, every rule's
expression, and the operands of an alert's condition (what must have data for the alert to
mean anything: `a > 0.9` fires never, silently, when `a` is misspelt)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m"}
"""What the test puts for Grafana's built-in variables (1 s scrapes: 30 s holds many)."""

_COMPARISONS = ("==", "!=", ">=", "<=", ">", "<")
_SET_OPERATORS = ("and", "or", "unless")
_MODIFIERS = re.compile(
    r"^\s*(?:bool\b|(?:on|ignoring|group_left|group_right)\s*(?:\([^)]*\))?)\s*"
)
_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$", re.IGNORECASE)


def grafana(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel (rows included)."""
    found = []
    stack = list(json.loads(path.read_text())["panels"])
    while stack:
        panel = stack.pop(0)
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            found.append((f"{panel['title']} [{target['refId']}]", grafana(target["expr"])))
    return found


def rules(path: Path) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(recording rules, alerting rules) as (name, expression)."""
    recording, alerting = [], []
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                recording.append((rule["record"], rule["expr"]))
            else:
                alerting.append((rule["alert"], rule["expr"]))
    return recording, alerting


def alert_operands(expr: str) -> list[str]:
    """The operands of the comparisons and set operators at the top of `expr` (number
    literals left out; a parenthesized operand is split in turn)."""
    out = []
    for part in _split_top(expr):
        part = part.strip()
        while True:
            stripped = _MODIFIERS.sub("", part, count=1).strip()
            if stripped == part:
                break
            part = stripped
        if _wrapped(part):
            inner = part[1:-1]
            pieces = _split_top(inner)
            if len(pieces) > 1:
                out.extend(alert_operands(inner))
                continue
        if part and not _NUMBER.match(part):
            out.append(part)
    return out


def _split_top(expr: str) -> list[str]:
    """`expr` cut at its top-level comparison and set operators."""
    parts, depth, start, i, quote = [], 0, 0, 0, ""
    while i < len(expr):
        c = expr[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            width = _operator_at(expr, i)
            if width:
                parts.append(expr[start:i])
                i += width
                start = i
                continue
        i += 1
    parts.append(expr[start:])
    return parts


def _operator_at(expr: str, i: int) -> int:
    for op in _COMPARISONS:
        if expr.startswith(op, i) and not expr.startswith(("=~", "!~"), i):
            return len(op)
    for op in _SET_OPERATORS:
        end = i + len(op)
        if (
            expr.startswith(op, i)
            and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_:"))
            and (end == len(expr) or not (expr[end].isalnum() or expr[end] in "_:"))
        ):
            return len(op)
    return 0


def _wrapped(expr: str) -> bool:
    """Whether the whole of `expr` is one parenthesized group."""
    if not (expr.startswith("(") and expr.endswith(")")):
        return False
    depth = 0
    for i, c in enumerate(expr):
        depth += c == "("
        depth -= c == ")"
        if depth == 0 and i < len(expr) - 1:
            return False
    return True
