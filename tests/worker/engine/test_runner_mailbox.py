"""The runner's mailbox takes only the items its producers put there (`Dispatched` from the
manager, `OpenStream`, `Barrier` and `_CancelActive` from the runner itself, the input
queue's `AppendReady` / `CommitReady` / `InOrder` / `Dropped`, `PartialTranscript`,
`IdleDue`, and the stage's `StageOutput`): any other item is a bug, refused with a
TypeError (the session's internal_error, logged), never run as if it were a command."""

import logging

import pytest

from shared.protocol.duplex import parse_client_event


def note(item_id: str, event_id: str) -> dict:
    return {
        "type": "conversation.item.create",
        "event_id": event_id,
        "item": {
            "id": item_id,
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": f"text of {item_id}"}],
        },
    }


async def test_an_unknown_mailbox_item_raises_type_error(harness):
    session = await harness.open()
    runner = harness.manager.table.runner(session.session_id)
    with pytest.raises(TypeError, match="not a mailbox item"):
        await runner._handle(object())


async def test_a_command_put_in_the_mailbox_unwrapped_is_refused_not_run(harness, caplog):
    """A bare command (the manager always wraps one in `Dispatched`, with its reservation
    and mark) used to be dispatched by the fallback branch, bypassing both."""
    session = await harness.open()
    runner = harness.manager.table.runner(session.session_id)
    caplog.set_level(logging.ERROR, "services.worker.engine.runner")
    runner.submit(parse_client_event(note("item_raw", "bare")))
    error = await session.recv()
    assert error.wire_type == "error", error
    assert error.code == "internal_error" and "not a mailbox item" in error.message
    assert any(r.exc_info and r.exc_info[0] is TypeError for r in caplog.records)
    # the session goes on: a command submitted as the manager does is served
    await session.send(parse_client_event(note("item_ok", "wrapped")))
    created = await session.recv()
    assert (created.wire_type, created.item["id"]) == ("conversation.item.added", "item_ok")
