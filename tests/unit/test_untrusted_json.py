"""JSON nested past the parser's depth raises RecursionError, not ValueError: every parse of input
from outside (a cursor a client sends back, a provider's answer, a sign-in body) answers it as the
malformed input it is, never as a 500."""
from __future__ import annotations

import base64

import pytest

from aivedio.errors import InvalidRequest
from aivedio.policy import tenant_policy
from aivedio.pricing import price_book

DEEP = "[" * 30_000 + "]" * 30_000


def _cursor(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def test_a_cursor_nested_past_the_parsers_depth_is_an_invalid_cursor():
    with pytest.raises(InvalidRequest):
        tenant_policy._from_cursor(_cursor(DEEP))
    with pytest.raises(InvalidRequest):
        price_book.list_price_versions(None, cursor=_cursor(DEEP))  # refused before any query
