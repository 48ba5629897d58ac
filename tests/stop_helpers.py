"""Stop strings cut out of a greedy reference output (a token boundary inside one, or one inside a
token, or one ending on a token's first character), so that no stop-string test depends on what the synthetic model happens to say
(test_serve_api.py, test_choices.py, test_serve_echo.py)."""

from __future__ import annotations


def token_texts(tok, ids: list[int]) -> list[str]:
    return [tok.decode([t]) for t in ids]


def spanning_stop(tok, ids: list[int]) -> tuple[str, int, str]:
    """(a stop string made of the end of one token's text and the start of the next's, the tokens
    generated up to the one completing it, the text before it), from greedy ``ids``."""
    texts, text = token_texts(tok, ids), tok.decode(ids)
    assert "".join(texts) == text
    for k in range(1, len(ids) - 1):
        a, b = texts[k], texts[k + 1]
        start = len("".join(texts[: k + 1])) - 2
        if len(a) >= 2 and len(b) >= 2 and text.find(a[-2:] + b[:2]) == start:
            return a[-2:] + b[:2], k + 2, text[:start]
    raise AssertionError(f"no token boundary to put a stop string on in {texts}")


def inner_stop(tok, ids: list[int], after: int) -> tuple[str, int, str]:
    """A stop string inside one token's text (text after it in that token is cut too), in a
    token from index ``after`` on."""
    texts, text = token_texts(tok, ids), tok.decode(ids)
    for k in range(after, len(ids)):
        start = len("".join(texts[:k])) + 1
        if len(texts[k]) >= 4 and text.find(texts[k][1:3]) == start:
            return texts[k][1:3], k + 1, text[:start]
    raise AssertionError(f"no token of 4+ characters in {texts[after:]}")


def stop_at_a_token_start(tok, ids: list[int], after: int) -> tuple[str, int, str]:
    """(a stop string of one token's last character and the next token's first, the tokens
    generated up to the one completing it, the text before it), completed by a token from index
    ``after`` on. Only its first character is held back before that token comes (a stop string's
    length - 1), so that token adds no text: the text before the stop string was all handed out."""
    text = tok.decode(ids)
    for k in range(max(1, after), len(ids)):
        a, b = tok.decode(ids[:k]), tok.decode(ids[: k + 1])
        if len(b) > len(a) and b.startswith(a) and "\ufffd" not in b[len(a) - 1 : len(a) + 1]:
            stop = b[len(a) - 1 : len(a) + 1]
            if text.find(stop) == len(a) - 1:
                return stop, k + 1, a[:-1]
    raise AssertionError(f"no token boundary from token {after} on to end a stop string on in {token_texts(tok, ids)}")
