"""The published wire reference cannot drift from the registries."""

from pathlib import Path

from shared.protocol.duplex import CLIENT_COMMAND_TYPES, ERROR_CODES, SERVER_EVENT_TYPES
from shared.protocol.duplex.reference import BEGIN, END, render_reference, splice

ROOT = Path(__file__).resolve().parents[1]


def test_wire_api_reference_block_is_current():
    document = (ROOT / "docs" / "wire-api.md").read_text()
    assert BEGIN in document and END in document
    assert splice(document, render_reference()) == document, (
        "docs/wire-api.md is stale: run python -m shared.protocol.duplex.reference --write"
    )


def test_reference_lists_every_type_and_code():
    generated = render_reference()
    for wire_type in [*SERVER_EVENT_TYPES, *CLIENT_COMMAND_TYPES]:
        assert f"| `{wire_type}` |" in generated, wire_type
    for code in ERROR_CODES:
        assert f"| `{code}` |" in generated, code


def test_readme_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    head = readme[: readme.index("\n## ")] if "\n## " in readme else readme
    assert "make serve" in head and "make test" in head
