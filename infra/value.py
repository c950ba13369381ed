"""A declared value (`[ranking] value`): what a list is ordered by, an arithmetic expression over each objective's
probability over the exposures (one `over` another is already P(click) x P(buy | click)), the item's numeric
attributes and the request's number context fields (a shop's expected takings `buy * price`, an ad's eCPM
`click * bid`). Parsed once, checked against the spec's names at load, evaluated without `eval`: only
numbers, names, + - * / and parentheses are expressions of it.

The same expression over the outcomes (each objective's label in place of its prediction) is what a list earned: the
realised value an order by it is judged on.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

# Standard library at import (the spec that declares it is read in the Flink job's environment); numpy's arrays
# when evaluated.
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
OPERATORS = "numbers, names, + - * / and parentheses"


@dataclass(frozen=True)
class ValueExpression:
    text: str
    names: tuple[str, ...]  # the names it reads, each once, in the order written
    _tree: ast.expr = field(compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> ValueExpression:
        """The expression in `text`, or ValueError naming the first thing it may not hold."""
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"not an expression ({exc.msg}): {text!r}") from None
        for node in ast.walk(tree):
            if not _allowed(node):
                raise ValueError(f"{ast.unparse(node)!r} is not allowed in {text!r}: a value holds {OPERATORS}")
            if isinstance(node, ast.Constant) and not math.isfinite(_float(node.value)):
                raise ValueError(f"{ast.get_source_segment(text.strip(), node)!r} in {text!r} is no finite number")
        written = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Name)), key=lambda n: (n.lineno, n.col_offset))
        return cls(text, tuple(dict.fromkeys(n.id for n in written)), tree)

    def __call__(self, given: Mapping[str, np.ndarray | float]) -> np.ndarray:
        """Its value per row of `given` (each name an array of the rows, or one number for all); a row dividing by
        zero is worth 0, not infinity, so that it cannot take the top of a list."""
        import numpy as np

        with np.errstate(divide="ignore", invalid="ignore"):
            out = np.asarray(self._evaluate(self._tree, given), np.float64)
        return np.where(np.isfinite(out), out, 0.0)

    def _evaluate(self, node: ast.expr, given: Mapping[str, np.ndarray | float]) -> np.ndarray | float:
        if isinstance(node, ast.Name):
            import numpy as np

            return np.asarray(given[node.id], np.float64)
        if isinstance(node, ast.Constant):
            return _float(node.value)
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._evaluate(node.operand, given))
        assert isinstance(node, ast.BinOp)  # parse admits nothing else
        return _BINARY[type(node.op)](self._evaluate(node.left, given), self._evaluate(node.right, given))


def _allowed(node: ast.AST) -> bool:
    return (isinstance(node, (ast.Name, ast.Load, *_BINARY, *_UNARY))
            or isinstance(node, ast.BinOp) and type(node.op) in _BINARY
            or isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY
            or isinstance(node, ast.Constant) and type(node.value) in (int, float))


def _float(x: float) -> float:
    try:
        return float(x)
    except OverflowError:  # an integer past a float's range
        return math.inf
