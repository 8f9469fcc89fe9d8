"""Demo tools for the embedded tiny model: module-level (picklable), type-hinted, Google-style docstrings.

transformers turns each into a JSON schema (``transformers.utils.get_json_schema``) that the chat
template renders into the system block. The tiny model is warm-started to call them on arithmetic
questions, and agent training can pass them as ``tools=[add, subtract, multiply]``.
"""

from __future__ import annotations

__all__ = ["ARITHMETIC_TOOLS", "add", "multiply", "subtract", "tool_for_operator"]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum a + b.
    """
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract one integer from another.

    Args:
        a: The integer to subtract from.
        b: The integer to subtract.

    Returns:
        The difference a - b.
    """
    return a - b


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product a * b.
    """
    return a * b


ARITHMETIC_TOOLS = (add, subtract, multiply)

_BY_OPERATOR = {"+": add, "-": subtract, "×": multiply, "*": multiply}


def tool_for_operator(op: str):
    """The tool that computes ``op`` ("+", "-", "×" or "*")."""
    return _BY_OPERATOR[op]
