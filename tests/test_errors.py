"""One coded-error base: every error that carries a contract code subclasses CodedError and
reads its error type and retryability from the code table."""

import ast
from pathlib import Path

import pytest

from shared.client.duplex_client import DuplexClientError
from shared.contracts import DuplexSessionError
from shared.contracts.plugin import DuplexRuntimeConfigError
from shared.errors import CodedError
from shared.protocol.duplex import ERROR_CODES, RealtimeProtocolError
from shared.redis.store import SessionStoreError

ROOT = Path(__file__).resolve().parents[1]
CODED = [
    RealtimeProtocolError,
    DuplexSessionError,
    DuplexRuntimeConfigError,
    DuplexClientError,
    SessionStoreError,
]


@pytest.mark.parametrize("cls", CODED, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "code, error_type, retryable",
    [
        ("bad_event", "invalid_request_error", None),
        ("worker_lost", "server_error", True),
        ("resource_exhausted", "rate_limit_error", True),
        ("not_a_code_of_ours", "invalid_request_error", None),
    ],
)
def test_every_coded_error_classifies_through_the_table(cls, code, error_type, retryable):
    error = cls(code, "why")
    assert isinstance(error, CodedError)
    assert (error.code, error.message, str(error)) == (code, "why", f"{code}: why")
    assert (error.error_type, error.retryable) == (error_type, retryable)


def test_the_table_is_what_the_base_reads():
    for code, entry in ERROR_CODES.items():
        error = CodedError(code)
        assert (error.error_type, error.retryable) == (entry.error_type, entry.retryable)
        assert error.message == code and str(error) == code


def test_no_other_exception_class_keeps_a_code_of_its_own():
    """An exception class that sets `self.code` itself is a second coded-error tree."""
    offenders = []
    for top in ("shared", "services", "plugins"):
        for path in (ROOT / top).rglob("*.py"):
            if path == ROOT / "shared" / "errors.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                for inner in ast.walk(node):
                    targets = inner.targets if isinstance(inner, ast.Assign) else []
                    if any(
                        isinstance(t, ast.Attribute)
                        and t.attr == "code"
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                        for t in targets
                    ) and any(
                        isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception"))
                        for b in node.bases
                    ):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert offenders == []


def test_a_session_error_names_its_field_as_param_not_as_an_extra():
    error = DuplexSessionError("invalid_session_config", "bad voice", param="voice", hint=1)
    assert (error.param, error.extra) == ("voice", {"hint": 1})
    assert error.to_event().param == "voice"


#: module constants that equal a code by coincidence: they are not error codes
NOT_CODES = {("shared/ids.py", "EXPIRED_CLOSE_REASON")}  # a close reason, "timeout"


def _coded_classes(trees: list[ast.Module]) -> set[str]:
    """The names of every class that takes a code: CodedError and its subclasses."""
    names = {"CodedError"}
    grew = True
    while grew:
        grew = False
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names:
                    bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                    if bases & names:
                        names.add(node.name)
                        grew = True
    return names


def _code_arguments(call: ast.Call, coded: set[str]) -> list[ast.expr]:
    """The arguments of a call that name an error code: the first of a coded error's
    constructor or of `for_code`, and any `error_code=`."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    named = [k.value for k in call.keywords if k.arg == "error_code"]
    takes_code = name in coded or name == "for_code"
    return ([call.args[0]] if takes_code and call.args else []) + named


def test_error_codes_come_from_the_table_only():
    """Every code the services write as a string is one of the table's (a typo is not a
    new code), and a code a module names as a constant is named in errors.py only (one
    "worker_lost", not one per module)."""
    unknown, constants = [], []
    paths = [
        path for top in ("shared", "services", "plugins") for path in (ROOT / top).rglob("*.py")
    ]
    trees = {path: ast.parse(path.read_text()) for path in paths}
    coded = _coded_classes(list(trees.values()))
    assert {"DuplexSessionError", "RealtimeProtocolError", "SessionStoreError"} <= coded
    for path, tree in trees.items():
        where = str(path.relative_to(ROOT))
        if path.parent.name == "client":
            continue  # the client library's own codes (its reconnect's) are not sent
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for arg in _code_arguments(node, coded):
                    literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                    if literal and arg.value not in ERROR_CODES:
                        unknown.append(f"{where}:{node.lineno}: {arg.value}")
        if path.name == "errors.py":
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and node.value.value in ERROR_CODES
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name) and (where, target.id) not in NOT_CODES:
                        constants.append(f"{where}:{node.lineno}: {target.id}")
    assert unknown == [] and constants == []
