"""CSV cells a spreadsheet shows and never runs: the one formula-injection rule for every CSV we write."""
from __future__ import annotations

# A spreadsheet runs a cell that starts with one of these as a formula (=HYPERLINK(...) and worse).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def neutralise(text: str) -> str:
    """Text as a spreadsheet shows it, never runs it (the OWASP CSV-injection rule: a leading quote).

    Text that already starts with a quote gets one too, so `restore` gives back exactly what was written.
    """
    return "'" + text if text.startswith(FORMULA_STARTS + ("'",)) else text


def restore(text: str) -> str:
    """The text `neutralise` was given (for readers of our own CSV files)."""
    return text[1:] if text.startswith("'") else text


def safe_cell(value: object) -> object:
    """Numbers (and booleans, None) as they are; any text neutralised."""
    return neutralise(value) if isinstance(value, str) else value
