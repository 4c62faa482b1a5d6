"""API keys in any alphabet, the WebSocket Origin rule and the console's headers
(services/api/security.py)."""

import hmac

import pytest

from services.api import security
from services.api.security import KeyChecker, content_security_policy, origin_allowed


def test_keys_of_any_alphabet_are_compared_never_raised_on():
    check = KeyChecker(["sk-one", "sk-two", "clé-été"])
    assert check.enabled
    assert check("sk-one") and check("sk-two") and check("clé-été")
    for wrong in (None, "", "sk-on", "sk-one ", "été", "Ã©tÃ©", "\udcff", "🔑" * 100):
        assert not check(wrong), wrong
    open_pod = KeyChecker([])
    assert not open_pod.enabled and open_pod(None) and open_pod("été")


def test_every_known_key_is_compared_every_time(monkeypatch):
    calls = []
    compare = hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return compare(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", counting)
    check = KeyChecker(["k1", "k2", "k3"])
    assert check("k1")
    assert len(calls) == 3  # no early exit on the first match


HOST = "duplex.example.com"


@pytest.mark.parametrize(
    "origin, host, allowed, keys, expected",
    [
        (None, HOST, frozenset(), False, True),  # not a browser: the SDK, curl
        ("https://duplex.example.com", HOST, frozenset(), False, True),  # its own console
        ("https://DUPLEX.example.com/", HOST, frozenset(), False, True),
        ("https://duplex.example.com", "duplex.example.com:443", frozenset(), False, True),
        ("http://127.0.0.1:8000", "127.0.0.1:8000", frozenset(), False, True),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", frozenset(), False, False),  # other port
        ("https://evil.example", HOST, frozenset(), False, False),
        ("null", HOST, frozenset(), False, False),  # sandboxed frames, file:// pages
        ("https://evil.example", HOST, frozenset(), True, True),  # the key is the credential
        ("https://evil.example", HOST, frozenset({"https://app.example"}), True, False),
        ("https://app.example", HOST, frozenset({"https://app.example"}), False, True),
        ("https://evil.example", HOST, frozenset({"*"}), False, True),
        ("https://evil.example", None, frozenset(), False, False),
    ],
)
def test_websocket_origin_rule(origin, host, allowed, keys, expected):
    assert origin_allowed(origin, host, allowed, keys) is expected


def test_the_policy_allows_the_console_and_nothing_else():
    policy = content_security_policy("127.0.0.1:8000")
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == directives["style-src"] == "'self'"  # no inline code
    assert directives["connect-src"] == "'self' ws://127.0.0.1:8000 wss://127.0.0.1:8000"
    assert directives["frame-ancestors"] == "'none'"
    # a Host header that is not a host is never echoed into a header
    assert "connect-src 'self';" in content_security_policy("evil; script-src *")
    assert "connect-src 'self';" in content_security_policy(None)
    assert "[::1]:8000" in content_security_policy("[::1]:8000")
