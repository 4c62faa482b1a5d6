"""A MiniCPM-o 4.5 checkpoint loaded into our parts: the language model, the audio tower,
the vision tower, the speech-token model and the tokenizer.

`MiniCPMOWeights.load(model_dir)` reads `config.json` (checked by each part's config),
builds every part on the meta device (no memory, no random init: the 8B model is
allocated once, by its weights) and loads each from the checkpoint strictly under its
published prefix. Parameters the duplex loop never uses are left on disk, by name:
`tts.model.embed_tokens` and `tts.projector_spk` (the speech model is fed embeddings, and
its speaker projector is not part of duplex mode), and a SigLIP layer past the ones the
model runs (`drop_vision_last_layer`: the reference builds one layer fewer than the config
counts, and a checkpoint may still hold the last one).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from plugins.minicpmo.audio import AudioConfig, AudioTower
from plugins.minicpmo.config import LanguageConfig, ModelDirError, SpeechConfig, read_config
from plugins.minicpmo.language import LanguageModel
from plugins.minicpmo.speech import UNUSED_SPEECH_PARAMETERS, SpeechTokenModel
from plugins.minicpmo.vision import VisionConfig, VisionEncoder
from plugins.minicpmo.vocabulary import Vocabulary
from plugins.minicpmo.weights import load_part, read_parts


@dataclasses.dataclass
class MiniCPMOWeights:
    model_dir: Path
    language: LanguageModel
    audio: AudioTower
    vision: VisionEncoder
    speech: SpeechTokenModel
    vocabulary: Vocabulary
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def load(
        cls, model_dir: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> MiniCPMOWeights:
        model_dir = Path(model_dir)
        config = read_config(model_dir)
        preprocessor_path = model_dir / "preprocessor_config.json"
        preprocessor = (
            json.loads(preprocessor_path.read_text()) if preprocessor_path.is_file() else None
        )
        try:
            language_config = LanguageConfig.from_json(config)
            speech_config = SpeechConfig.from_json(config, language_config)
            audio_config = AudioConfig.from_json(config)
            vision_config = VisionConfig.from_json(config, preprocessor)
        except ModelDirError:
            raise
        except ValueError as exc:  # the audio and vision parts say what is wrong
            raise ModelDirError(f"{model_dir / 'config.json'}: {exc}") from None
        vocabulary = Vocabulary(model_dir)
        if language_config.vocab_size < vocabulary.tokenizer.get_vocab_size():
            raise ModelDirError("the tokenizer has more tokens than the language model's vocab")
        with torch.device("meta"):
            language = LanguageModel(language_config)
            audio = AudioTower(audio_config, dtype=dtype, device="meta")
            # eager attention on the CPU keeps the camera path bit-identical to the
            # reference's; on a GPU torch's fused attention (a batch of frames costs about a
            # third as much a frame, within 1e-6)
            attention = "eager" if torch.device(device).type == "cpu" else "sdpa"
            vision = VisionEncoder(vision_config, dtype=dtype, attn_implementation=attention)
            speech = SpeechTokenModel(speech_config)
        kept_layers = vision_config.encoder_layers
        parts = read_parts(
            model_dir,
            ("llm.", "apm.", "audio_projection_layer.", "vpm.", "resampler.", "tts."),
            dtype=dtype,
            device=device,
            skip={
                "tts.": UNUSED_SPEECH_PARAMETERS,
                "vpm.": (f"encoder.layers.{kept_layers}.",),
            },
        )
        load_part(language.llm, parts["llm."], "llm.")
        load_part(audio.apm, parts["apm."], "apm.")
        load_part(
            audio.audio_projection_layer,
            parts["audio_projection_layer."],
            "audio_projection_layer.",
        )
        load_part(vision.vpm, parts["vpm."], "vpm.")
        load_part(vision.resampler, parts["resampler."], "resampler.")
        load_part(speech, parts["tts."], "tts.")
        vision.resampler.rebuild_position_codes(device, dtype)
        for name, part in (
            ("language", language),
            ("audio", audio),
            ("vision", vision),
            ("speech", speech),
        ):
            part.eval()
            _check_materialised(part, name)
        return cls(
            model_dir=model_dir,
            language=language,
            audio=audio,
            vision=vision,
            speech=speech,
            vocabulary=vocabulary,
            dtype=dtype,
            device=torch.device(device),
        )


#: buffers transformers builds that our code never reads (our own RoPE replaces them)
_UNUSED_BUFFERS = ("llm.model.rotary_emb.",)


def _check_materialised(module: torch.nn.Module, part: str) -> None:
    """Every weight and buffer our code reads was loaded or computed: nothing is left on
    the meta device (which would fail at the first step, far from its cause)."""
    left = [
        name
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]
        if tensor.is_meta and not name.startswith(_UNUSED_BUFFERS)
    ]
    if left:
        raise ModelDirError(f"the {part} part has tensors the checkpoint did not give: {left[:5]}")


__all__ = ["MiniCPMOWeights"]
