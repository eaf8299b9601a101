"""How the bench reports write numbers in their markdown tables."""

from __future__ import annotations

import math


def format_number(value: float | None, digits: int = 1, separator: str = "") -> str:
    """One decimal by default; "-" for none (or NaN), "inf" for an infinite rate."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "inf" if math.isinf(value) else f"{value:{separator}.{digits}f}"


def format_grouped(value: float | None, digits: int = 1) -> str:
    """The pooled tables' numbers: thousands separated (1,234.5)."""
    return format_number(value, digits, separator=",")


def format_percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"
