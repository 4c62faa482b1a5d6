"""`assistant`: a CPU voice assistant (Silero VAD, Whisper tiny.en or pocketsphinx, a
responder or vLLM, espeak-ng)."""

from plugins.assistant.plugin import AssistantPlugin

__all__ = ["AssistantPlugin"]
