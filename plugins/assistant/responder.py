"""What the assistant says: a small deterministic responder, and the prompt for an LLM.

The built-in responder answers greetings, the time and date, its name, thanks, goodbyes and
"repeat after me ...", and says what it heard otherwise. With `--llm-model` the assistant
sends `llm_prompt(...)` to a vLLM text stage instead.

Function tools (the session's or the response's `tools`): the built-in responder calls a
tool when the user's words name it (`tool_call_for`): every word of the tool's name
(`get_weather` and `getWeather` read as "get weather", case-insensitive) appears in what
was said, in that order, other words between them allowed ("please get the weather").
When several tools are named, the one with the most words in its name wins (then the one
declared first). The arguments are `{}`, except for a tool whose `parameters` declare
exactly one property, of type string: it gets the words said after the name, leading
fillers ("in", "for", "the", ...) dropped ("get the weather in paris" -> `{"city":
"paris"}`). `tool_choice` "none" calls nothing, "required" calls the named tool or else
the first, `{"type": "function", "name"}` calls that tool whatever was said. A call says
nothing, unless the session sets `extra_body.announce_tool_calls: true`: then the
response first says "Let me use the get weather tool." (as GA models often announce a
call), and a barge-in while it speaks cancels the call with it. After the
client's `function_call_output`, the answer speaks it (`tool_answer`): "The get weather
tool says: <the output's first sentence>". With an LLM, the tools go into the prompt and
calls are read from the generated text (`tool_text.py`).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from plugins.assistant.tool_text import call_line, tools_prompt
from shared.contracts import FunctionCall
from shared.contracts.tools import ToolChoice, callable_tools, must_call

NAME = "the duplex serve assistant"

SORRY = "Sorry, I did not catch that."
#: the answer to a greeting, and what the assistant says when asked to speak first (a
#: response.create with no input at all, on the openai surface)
GREETING = "Hello! How can I help you?"


def _words(text: str) -> list[str]:
    # Whisper spells "goodbye" as "good bye": one word, so it is not taken for a greeting
    return re.findall(r"[a-z']+", re.sub(r"\bgood[ -]bye\b", "goodbye", text.lower()))


def understands(text: str) -> bool:
    """Whether `text` is one of the responder's commands (not "You said ..." or sorry)."""
    answer = reply(text)
    return answer != SORRY and not answer.startswith("You said")


def reply(text: str, now: datetime.datetime | None = None) -> str:
    """The built-in responder's answer to one user utterance."""
    now = now or datetime.datetime.now()
    words = _words(text)
    phrase = " ".join(words)
    if not words:
        return SORRY
    if phrase.startswith("repeat after me"):
        rest = " ".join(words[3:])
        return f"{rest.capitalize()}." if rest else "Repeat what?"
    if "time" in words:
        return f"It is {now.strftime('%H:%M')}."
    if "date" in words or ("day" in words and "what" in words):
        return f"Today is {now.strftime('%A, %B')} {now.day}."
    if "name" in words or phrase.startswith("who are you"):
        return f"I am {NAME}."
    if phrase.startswith("how are you"):
        return "I am fine, thank you. How can I help?"
    if phrase.startswith("can you hear me"):
        return "Yes, I can hear you."
    if words[0] in ("hello", "hi", "hey") or phrase.startswith("good "):
        return GREETING
    if words[0] in ("thanks", "thank"):
        return "You are welcome."
    if words[0] in ("goodbye", "bye") or phrase.startswith("see you"):
        return "Goodbye!"
    return f"You said: {phrase}."


def llm_prompt(
    history: Sequence[Mapping[str, Any]],
    user_text: str,
    instructions: str,
    tools: Sequence[Mapping[str, Any]] = (),
    tool_choice: ToolChoice = "auto",
    *,
    user_turn: bool = True,
) -> str:
    """A plain-text chat prompt: the instructions, the tools it may call, then the
    conversation, one line a turn (tool calls and outputs included, `tool_text.py`). Each
    turn extends the previous prompt, so vLLM's prefix cache reuses the earlier turns.
    `user_turn` False: the response answers no spoken turn (a function output, the
    client's text items, or nothing: the assistant speaks first), so no "User:" line is
    added beyond what history holds."""
    lines = [instructions.strip() or f"You are {NAME}. Answer in one short sentence."]
    lines += tools_prompt(callable_tools(tools, tool_choice), tool_choice)
    for item in history:
        if item.get("type") != "message":
            if call_line(item):
                lines.append(call_line(item))
            continue
        said = " ".join(
            str(part.get("transcript") or part.get("text") or "")
            for part in item.get("content") or []
        ).strip()
        if said:
            lines.append(f"{'User' if item.get('role') == 'user' else 'Assistant'}: {said}")
    answering_tool = not user_text and bool(tool_outputs(history))
    if user_turn and not answering_tool and (not lines[-1].endswith(user_text) or not user_text):
        lines.append(f"User: {user_text}")
    lines.append("Assistant:")
    return "\n".join(lines)


def sentences(text: str) -> tuple[list[str], str]:
    """Complete sentences in `text`, and the unfinished rest (for speaking as text streams)."""
    parts = re.split(r"(?<=[.!?])\s+", text)
    if parts and not re.search(r"[.!?]$", parts[-1]):
        return [p for p in parts[:-1] if p.strip()], parts[-1]
    return [p for p in parts if p.strip()], ""


# ---------------------------------------------------------------- function tools

#: words dropped before a single string argument ("get the weather in paris" -> "paris")
FILLERS = frozenset({"in", "for", "of", "the", "a", "an", "at", "on", "to", "about", "me"})
#: the longest tool output spoken, in characters (cut at a word)
MAX_SPOKEN_OUTPUT = 200


def name_words(name: str) -> list[str]:
    """A tool's name as words: `get_weather`, `get-weather`, `getWeather` -> get, weather."""
    return _words(re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name).replace("_", " ").replace("-", " "))


def tool_call_for(
    text: str, tools: Sequence[Mapping[str, Any]], tool_choice: ToolChoice = "auto"
) -> FunctionCall | None:
    """The call the built-in responder makes for what the user said, or None (module head)."""
    offered = callable_tools(tools, tool_choice)
    if not offered:
        return None
    words = _words(text)
    best: tuple[Mapping[str, Any], int, int] | None = None  # tool, name length, end of name
    for tool in offered:
        wanted = name_words(str(tool["name"]))
        end = _subsequence_end(words, wanted)
        if end is not None and (best is None or len(wanted) > best[1]):
            best = (tool, len(wanted), end)
    if best is None:
        if not must_call(tool_choice):
            return None
        best = (offered[0], 0, len(words))  # forced: nothing said after a name
    tool, _, end = best
    return FunctionCall(str(tool["name"]), json.dumps(_arguments(tool, words[end:])))


def announcement(call: FunctionCall) -> str:
    """What the responder says before a call when calls are announced (module head)."""
    return f"Let me use the {' '.join(name_words(call.name))} tool."


def tool_answer(history: Sequence[Mapping[str, Any]]) -> str | None:
    """What the assistant says after the function outputs that end `history` (None when
    history does not end with one): each tool's output, its first sentence."""
    outputs = tool_outputs(history)
    if not outputs:
        return None
    said = []
    for output in outputs:
        call = next(
            (
                item
                for item in history
                if item.get("type") == "function_call"
                and item.get("call_id") == output.get("call_id")
            ),
            None,
        )
        name = " ".join(name_words(str(call.get("name")))) if call else "requested"
        said.append(f"The {name} tool says: {_spoken_output(str(output.get('output', '')))}")
    return " ".join(said)


def tool_outputs(history: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The function_call_output items that end `history`, before the response's own item
    (the in-progress assistant message the worker adds before planning)."""
    items = list(history)
    if items and items[-1].get("role") == "assistant" and items[-1].get("status") == "in_progress":
        items.pop()
    outputs: list[Mapping[str, Any]] = []
    while items and items[-1].get("type") == "function_call_output":
        outputs.insert(0, items.pop())
    return outputs


def _subsequence_end(words: Sequence[str], wanted: Sequence[str]) -> int | None:
    """The index after the last of `wanted` found in `words` in order, or None."""
    position = 0
    for word in wanted:
        try:
            position = words.index(word, position) + 1
        except ValueError:
            return None
    return position if wanted else None


def _arguments(tool: Mapping[str, Any], rest: Sequence[str]) -> dict[str, str]:
    parameters = tool.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if not isinstance(properties, Mapping) or len(properties) != 1:
        return {}
    ((key, schema),) = properties.items()
    if not isinstance(schema, Mapping) or schema.get("type") != "string":
        return {}
    words = list(rest)
    while words and words[0] in FILLERS:
        words.pop(0)
    return {str(key): " ".join(words)} if words else {}


def _spoken_output(output: str) -> str:
    """A tool's output as one short spoken sentence (a JSON string or object is read out)."""
    try:
        value: Any = json.loads(output)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        value = output
    if isinstance(value, Mapping):
        text = ", ".join(
            f"{key} is {item}" for key, item in value.items() if isinstance(item, str | int | float)
        )
    else:
        text = value if isinstance(value, str) else output
    text = " ".join(text.split())
    done, rest = sentences(text)
    text = done[0] if done else rest
    if len(text) > MAX_SPOKEN_OUTPUT:
        text = text[:MAX_SPOKEN_OUTPUT].rsplit(" ", 1)[0]
    if not text:
        return "nothing."
    return text if re.search(r"[.!?]$", text) else text + "."
