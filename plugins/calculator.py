"""``calculator``: a tool the agent calls by writing ``<calc>EXPRESSION</calc>``.

The expression is parsed here (numbers, ``+ - * /``, parentheses, unary minus), never ``eval``-ed. The
result is the tool's reply (``= 42``); a malformed call is answered with an error message the model reads as
the tool result, and the episode goes on. A turn without ``<calc>`` is the agent's final answer: the episode
ends and the reward stack scores it (e.g. ``match`` against the prompt's reference). A turn's last call is
the one answered: ``Calculator-v0`` ends a turn at ``</calc>`` (its ``stop``), so a turn holds one.
"""

from __future__ import annotations

import decimal
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from textgym import Reply, hookimpl
from textgym.responders import Conversation

INSTRUCTIONS = (
    "You can use a calculator: write <calc>expression</calc> with numbers, + - * / and parentheses, "
    "e.g. <calc>(12 + 3) * 4</calc>, and its result comes back. Then give your final answer without <calc>."
)
MAX_LENGTH = 200  # characters of an expression: no number grows past what a short expression can write
# a number, or any other character but whitespace (so "14 + 15 " ends cleanly rather than on an unexpected " ")
TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\S))")


class CalcError(ValueError):
    """A malformed expression; the message is what the model reads."""


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``: numbers (``12``, ``3.5``, ``.5``), ``+ - * /``, parentheses and
    unary signs, with the usual precedence. Raises :class:`CalcError` with a message for the model."""
    if len(expression) > MAX_LENGTH:
        raise CalcError(f"the expression is longer than {MAX_LENGTH} characters")
    tokens: list[tuple[str, int]] = []  # (token, position)
    for match in TOKEN.finditer(expression):
        number, other = match.groups()
        if number is not None:
            tokens.append((number, match.start(1)))
        elif other is not None:
            if other not in "+-*/()":
                raise CalcError(f"unexpected {other!r} at position {match.start(2)}")
            tokens.append((other, match.start(2)))
    if not tokens:
        raise CalcError("the expression is empty")
    pos = 0

    def peek() -> str | None:
        return tokens[pos][0] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1][0]

    def where() -> str:
        return f"at position {tokens[pos][1]}" if pos < len(tokens) else "at the end"

    def expr() -> Fraction:  # expr := term (("+" | "-") term)*
        value = term()
        while peek() in ("+", "-"):
            value = value + term() if take() == "+" else value - term()
        return value

    def term() -> Fraction:  # term := factor (("*" | "/") factor)*
        value = factor()
        while peek() in ("*", "/"):
            op = take()
            right = factor()
            if op == "*":
                value *= right
            elif right == 0:
                raise CalcError("division by zero")
            else:
                value /= right
        return value

    def factor() -> Fraction:  # factor := ("+" | "-") factor | number | "(" expr ")"
        token = peek()
        if token in ("+", "-"):
            take()
            return factor() if token == "+" else -factor()
        if token == "(":
            take()
            value = expr()
            if peek() != ")":
                raise CalcError(f"expected ')' {where()}")
            take()
            return value
        if token is None or token in "*/)":
            raise CalcError(f"expected a number {where()}")
        return Fraction(take())

    value = expr()
    if pos < len(tokens):
        raise CalcError(f"unexpected {tokens[pos][0]!r} {where()}")
    return value


EXACT_DIGITS = 20  # a finite decimal with at most this many significant digits is written out exactly


def format_number(value: Fraction) -> str:
    """``value`` in plain decimal notation, never in exponent form (which the calculator does not read back):
    exactly where it has a finite decimal form of at most 20 significant digits (14, 3.5, 1000000002.5);
    else rounded to 10 significant digits, as ``≈0.3333333333`` (the mark says it is rounded)."""
    if value.denominator == 1:
        return str(value.numerator)
    rest, places = value.denominator, 0
    for factor in (2, 5):
        count = 0
        while rest % factor == 0:
            rest, count = rest // factor, count + 1
        places = max(places, count)
    if rest == 1:  # a finite decimal: value * 10^places is a whole number
        digits = str(abs(value.numerator * 10**places // value.denominator)).rjust(places + 1, "0")
        if len(digits.lstrip("0")) <= EXACT_DIGITS:
            return f"{'-' if value < 0 else ''}{digits[:-places]}.{digits[-places:]}"
    with decimal.localcontext() as context:
        context.prec = 10
        rounded = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
    text = format(rounded, "f")
    return f"≈{text.rstrip('0').rstrip('.') if '.' in text else text}"


class Calculator:
    """The ``<calc>EXPRESSION</calc>`` tool.

    Args:
        instructions: append the tool's instructions (:data:`INSTRUCTIONS`) to every prompt.
    """

    name = "calculator"
    role = "tool"

    def __init__(self, instructions: bool = True):
        self.instructions = instructions

    def start(self, conversations: Sequence[Conversation]) -> list[str | None]:
        return [INSTRUCTIONS if self.instructions else None] * len(conversations)

    def __call__(self, conversations: Sequence[Conversation]) -> list[Reply]:
        return [self.reply(c.last) for c in conversations]

    def reply(self, turn: str) -> Reply:
        start = turn.rfind("<calc>")
        if start < 0:
            return Reply("", done=True)  # no call: the final answer
        body = turn[start + len("<calc>") :]
        end = body.find("</calc>")
        if end < 0:
            return Reply("error: the call is not closed with </calc>.")
        try:
            result = format_number(evaluate(body[:end]))
            return Reply(f"≈ {result[1:]}" if result.startswith("≈") else f"= {result}")
        except CalcError as exc:
            return Reply(f"error: {exc}.")


@hookimpl
def register_responders(register: Callable[..., None]) -> None:
    register("calculator", Calculator)
