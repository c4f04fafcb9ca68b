"""Argument parsing shared by the benchmark scripts."""

from __future__ import annotations


def positive_int_list(text: str, flag: str, example: str = "1,8") -> list[int]:
    """``flag``'s comma list of positive integers (``"1, 8,1"`` → ``[1, 8]``; duplicates dropped,
    order kept).

    Raises:
        ValueError: an empty list, or an item that is no integer or is < 1 (names ``flag``, the
            whole value and the item).
    """
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        try:
            n = int(item)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {item!r} is not an integer (expected e.g. {example})") from None
        if n < 1:
            raise ValueError(f"{flag} {text!r}: {n} < 1; each value must be >= 1")
        if n not in out:
            out.append(n)
    return out
