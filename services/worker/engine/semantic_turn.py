"""`semantic_vad`: when a pause in the user's speech ends the turn.

The server VAD (Silero, `vad.py`) still finds speech and silence; semantic_vad only
changes how much silence ends a turn. With a recogniser that punctuates (Whisper) the
words heard so far say whether the user finished a thought:

- FINISHED: the transcript ends in sentence-final punctuation (`.`, `?`, `!`), and its
  last word is not a hesitation ("um", "uh", ...): end after a short silence;
- UNFINISHED: it ends with a trailing-off or continuing mark (`...`, `…`, `,`, `;`, `:`,
  `-`), or its last word is a conjunction, preposition, article or filler ("and", "so",
  "um", "the", ...): wait up to the eagerness' maximum (OpenAI's 8 s / 4 s / 2 s);
- UNDECIDED: anything else (no punctuation, say), or no transcript at all (a plugin
  without partial recognition, or a decode still running): the eagerness-scaled silence
  that `TurnDetection.silence_duration_ms` holds for semantic_vad.

The table is in `SILENCE_MS`; docs/wire-api.md ("Turn detection") repeats it exactly.
A transcript counts for a pause only when it covers the audio up to that pause (its
decode started after the last speech frame): an older one describes fewer words.
"""

from __future__ import annotations

import dataclasses
import re

FINISHED = "finished"
UNDECIDED = "undecided"
UNFINISHED = "unfinished"

#: eagerness -> (silence after a FINISHED transcript, after an UNFINISHED one), in ms.
#: UNDECIDED uses the session's `silence_duration_ms` (the surface sets it per eagerness:
#: low 1500, medium/auto 800, high 300). UNFINISHED is OpenAI's documented maximum.
SILENCE_MS = {
    "low": (750, 8000),
    "medium": (400, 4000),
    "auto": (400, 4000),
    "high": (200, 2000),
}
#: silence after speech at which the detector asks for a transcript of the turn so far
#: (the `paused` VAD event): long enough to skip the gaps between words
PAUSE_PROBE_MS = 160

#: last words that say more is coming (lower case, punctuation stripped)
CONTINUATIONS = frozenset(
    {
        *("and", "or", "but", "so", "because", "cause", "if", "then", "than", "plus"),
        *("that", "which", "who", "whose", "where", "when", "while", "as", "like", "also"),
        *("to", "of", "for", "with", "from", "in", "on", "at", "by", "about", "into"),
        *("the", "a", "an", "my", "your", "our", "their", "his", "her", "its", "this"),
        *("these", "those", "is", "are", "was", "were", "am", "be", "i", "we", "you"),
        *("they", "he", "she", "it", "well", "um", "uh", "er", "erm", "ah", "hmm", "mm"),
        "uhm",
    }
)
#: hesitations: unfinished even before a full stop ("Well, um.")
HESITATIONS = frozenset({"um", "uh", "er", "erm", "ah", "hmm", "mm", "uhm"})

# closing quotes and brackets after the last mark; the marks, CJK full-width ones too
_CLOSERS = "\"')]}\u00bb\u201d\u2019 \t\n"
_TRAILING_OFF = ("...", "\u2026")
_CONTINUING_MARKS = (",", ";", ":", "-", "\u2013", "\u2014")
_FINAL_MARKS = (".", "?", "!", "\u3002", "\uff1f", "\uff01")
_WORD = re.compile(r"[\w']+")


def classify(transcript: str | None) -> str:
    """FINISHED, UNFINISHED or UNDECIDED for the words heard so far (module docstring)."""
    text = (transcript or "").rstrip(_CLOSERS)
    if not text:
        return UNDECIDED
    words = _WORD.findall(text.lower())
    last = words[-1] if words else ""
    if text.endswith(_TRAILING_OFF) or text.endswith(_CONTINUING_MARKS):
        return UNFINISHED
    if text.endswith(_FINAL_MARKS):
        return UNFINISHED if last in HESITATIONS else FINISHED
    return UNFINISHED if last in CONTINUATIONS else UNDECIDED


@dataclasses.dataclass(frozen=True)
class TurnHint:
    """The latest partial transcript's verdict, and the stream time its audio reached."""

    verdict: str
    covers_ms: int


def silence_needed_ms(eagerness: str | None, undecided_ms: float, verdict: str) -> float:
    """How much silence after the last speech frame ends the turn."""
    finished, unfinished = SILENCE_MS.get(eagerness or "auto", SILENCE_MS["auto"])
    if verdict == FINISHED:
        return min(finished, undecided_ms)  # never slower than saying nothing
    if verdict == UNFINISHED:
        return max(unfinished, undecided_ms)
    return undecided_ms


__all__ = [
    "FINISHED",
    "PAUSE_PROBE_MS",
    "SILENCE_MS",
    "UNDECIDED",
    "UNFINISHED",
    "TurnHint",
    "classify",
    "silence_needed_ms",
]
