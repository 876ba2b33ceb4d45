"""Bytes are tokens: vocabulary 256, nothing to download, any text round-trips."""

from __future__ import annotations


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    return bytes(tokens).decode("utf-8", errors="replace")
