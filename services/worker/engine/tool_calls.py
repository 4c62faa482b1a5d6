"""Function calling in a session (the OpenAI Realtime GA flow), for the response
controller and the command handlers.

1. Tools: a response may call the `tools` of its `response.create`, else the session's
   (`plan_tools`), under its `tool_choice`; both reach the plugin in `ResponsePlanRequest`.
2. A stage output of kind "function_call" is held on its response (`hold_call`): nothing
   of it is emitted yet.
3. When the response completes, its assistant message item closes as always, then each
   held call becomes an output item (`with_calls`), at the output_index after it (1, 2,
   ...; on the openai surface a response that said nothing has no message item, as in
   GA, and its calls are at 0, 1, ...):
   `response.output_item.added` -> `conversation.item.added` / `.created` ->
   `response.function_call_arguments.delta` (the whole arguments, one delta) ->
   `response.function_call_arguments.done` -> `response.output_item.done` ->
   `conversation.item.done`, and `response.done` lists it in `output`. The call item enters
   history right after the message item (at the end of history when there is none), and
   its `call_id` is pending until answered.
   A response cancelled (barge-in, `response.cancel`, ...) or failed before it completed
   drops its held calls: none of their events was sent and nothing enters history, so no
   call is ever left half-made or unanswerable.
4. The client answers with `conversation.item.create` of a `function_call_output`
   (`check_item`: `unknown_function_call`, `duplicate_function_output`).
5. `response.create` after that output plans a response with no new audio turn
   (`tool_output_turn`): the plugin reads its input from the end of history.

Pending calls are read from history (`Conversation.pending_call_ids`), so a checkpoint's
items carry them to another worker and an output sent after a move is still accepted.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from services.worker.engine.conversation import Conversation
from services.worker.engine.engine_session import EngineSession, new_item_id
from services.worker.engine.response import COMPLETED, ActiveResponse
from shared.contracts import (
    CommittedTurn,
    DuplexSessionConfig,
    DuplexSessionError,
    FunctionCall,
    ResponseCreateOptions,
)
from shared.contracts.tools import ToolChoice, read_tool_choice, read_tools
from shared.protocol.duplex import (
    ConversationItemAdded,
    ConversationItemCreated,
    ConversationItemDone,
    DuplexEvent,
    DuplexResponseDone,
    ResponseFunctionCallArgumentsDelta,
    ResponseFunctionCallArgumentsDone,
    ResponseOutputItemAdded,
    ResponseOutputItemDone,
)

log = logging.getLogger(__name__)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------- tools of a response


def check_response_tools(options: ResponseCreateOptions) -> None:
    """Refuse a `response.create` whose `tools` / `tool_choice` are malformed
    (`invalid_tools`), before anything of the response is emitted."""
    extra = options.extra_body
    if "tools" in options.declared:
        read_tools(extra.get("realtime_response_tools"), "response.tools")
    if "tool_choice" in options.declared:
        read_tool_choice(extra.get("realtime_response_tool_choice"), "response.tool_choice")


def plan_tools(
    config: DuplexSessionConfig, options: ResponseCreateOptions
) -> tuple[tuple[dict[str, Any], ...], ToolChoice]:
    """The tools and tool_choice one response runs with: `response.create`'s where it set
    them, the session's otherwise. Both were validated when they arrived; a value that
    is not valid now (a checkpoint of an older version) reads as no tools."""
    session, response = config.extra_body, options.extra_body
    try:
        tools = read_tools(
            response.get("realtime_response_tools")
            if "tools" in options.declared
            else session.get("realtime_tools")
        )
        choice = read_tool_choice(
            response.get("realtime_response_tool_choice")
            if "tool_choice" in options.declared
            else session.get("realtime_tool_choice")
        )
    except DuplexSessionError:
        log.warning("invalid tools in a checked configuration: the response gets none")
        return (), "auto"
    return tools, choice


# ---------------------------------------------------------------- calls of a response


def hold_call(response: ActiveResponse, call: FunctionCall | None) -> None:
    """Keep a call the stage made until its response completes (module head, 3)."""
    if call is None or not isinstance(call.name, str) or not call.name:
        log.warning("response %s: a function_call output without a name", response.response_id)
        return
    arguments = call.arguments if isinstance(call.arguments, str) else "{}"
    response.function_calls.append(
        {
            "id": new_item_id(),
            "object": "realtime.item",
            "type": "function_call",
            "status": "completed",
            "call_id": call.call_id or new_call_id(),
            "name": call.name,
            "arguments": arguments,
        }
    )


def with_calls(
    events: list[DuplexEvent],
    response: ActiveResponse,
    status: str,
    conversation: Conversation,
) -> list[DuplexEvent]:
    """The response's terminal chain with its held calls' items before `response.done`
    (completed), or as it is (the calls are dropped: module head, 3)."""
    calls, response.function_calls = response.function_calls, []
    if not calls or status != COMPLETED:
        return events
    at = next(i for i, event in enumerate(events) if isinstance(event, DuplexResponseDone))
    done = events[at]
    anchor = response.item_id if _holds(conversation, response.item_id) else None
    added: list[DuplexEvent] = []
    # after the message item, or in its place when it was never announced (module head, 3)
    index = response.output_index + (1 if response.announced else 0)
    for call in calls:
        previous = conversation.add(dict(call), anchor)
        anchor = call["id"]
        added += call_events(response.response_id, index, call, previous)
        index += 1
    assert isinstance(done, DuplexResponseDone)
    done.response["output"] = [*done.response.get("output", []), *(dict(c) for c in calls)]
    return [*events[:at], *added, *events[at:]]


def call_events(
    response_id: str, output_index: int, call: Mapping[str, Any], previous: str | None
) -> list[DuplexEvent]:
    """One function_call output item's events, in the GA order (module head, 3)."""
    opening = {**call, "status": "in_progress", "arguments": ""}
    scoped = {
        "response_id": response_id,
        "item_id": call["id"],
        "output_index": output_index,
        "call_id": call["call_id"],
    }
    return [
        ResponseOutputItemAdded(
            response_id=response_id, output_index=output_index, item=dict(opening)
        ),
        ConversationItemAdded(previous_item_id=previous, item=dict(opening)),
        ConversationItemCreated(previous_item_id=previous, item=dict(opening)),
        ResponseFunctionCallArgumentsDelta(**scoped, delta=call["arguments"]),
        ResponseFunctionCallArgumentsDone(**scoped, arguments=call["arguments"], name=call["name"]),
        ResponseOutputItemDone(response_id=response_id, output_index=output_index, item=dict(call)),
        ConversationItemDone(previous_item_id=previous, item=dict(call)),
    ]


def _holds(conversation: Conversation, item_id: str) -> bool:
    try:
        conversation.index_of(item_id)
    except DuplexSessionError:
        return False
    return True


# ---------------------------------------------------------------- the client's side


def check_item(conversation: Conversation, item: Mapping[str, Any]) -> None:
    """A client's function_call_output answers a known call once; a client's own
    function_call item must not reuse a call id history already holds."""
    if item.get("type") == "function_call_output":
        call_id = item["call_id"]
        if conversation.function_call(call_id) is None:
            raise DuplexSessionError(
                "unknown_function_call", f"no function call {call_id!r}", param="item.call_id"
            )
        if conversation.function_output(call_id) is not None:
            raise DuplexSessionError(
                "duplicate_function_output",
                f"function call {call_id!r} already has its output",
                param="item.call_id",
            )
    elif (
        item.get("type") == "function_call"
        and conversation.function_call(item["call_id"]) is not None
    ):
        raise DuplexSessionError(
            "bad_event", f"function call {item['call_id']!r} already exists", param="item.call_id"
        )


def tool_output_turn(session: EngineSession, sample_rate_hz: int) -> CommittedTurn | None:
    """The input of a `response.create` that follows a client's function_call_output (the
    last item of history): an empty turn, so the plugin answers from history. None when
    history does not end with one (the refusal stays `response_create_without_input`)."""
    items: Sequence[Mapping[str, Any]] = session.conversation.items
    if not items or items[-1].get("type") != "function_call_output":
        return None
    return CommittedTurn(
        session.turn_id, str(items[-1]["id"]), np.zeros(0, np.float32), sample_rate_hz
    )


__all__ = [
    "call_events",
    "check_item",
    "check_response_tools",
    "hold_call",
    "new_call_id",
    "plan_tools",
    "tool_output_turn",
    "with_calls",
]
