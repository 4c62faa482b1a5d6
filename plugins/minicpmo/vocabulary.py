"""The checkpoint's tokenizer and the special tokens the duplex loop is made of.

A unit is written in special tokens (`<unit>` ... `</unit>`, `<image>` ... `</image>`) and
the model answers in them (`<|listen|>`, `<|speak|>`, `<|chunk_eos|>`, `<|turn_eos|>`...).
Their ids are the tokenizer's, looked up by name, never assumed: the published tokenizer
puts them at 151643 and up, the tests' tiny one at small ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from plugins.minicpmo.config import ModelDirError


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    unit: int
    unit_end: int
    image: int
    image_end: int
    listen: int
    speak: int
    tts_bos: int
    chunk_eos: int
    chunk_tts_eos: int
    turn_eos: int
    tts_pad: int

    @property
    def unit_terminators(self) -> frozenset[int]:
        """Tokens that end a unit's answer (fed, then `</unit>`)."""
        return frozenset((self.listen, self.chunk_eos, self.chunk_tts_eos))


_NAMES = {
    "unit": "<unit>",
    "unit_end": "</unit>",
    "image": "<image>",
    "image_end": "</image>",
    "listen": "<|listen|>",
    "speak": "<|speak|>",
    "tts_bos": "<|tts_bos|>",
    "chunk_eos": "<|chunk_eos|>",
    "chunk_tts_eos": "<|chunk_tts_eos|>",
    "turn_eos": "<|turn_eos|>",
    "tts_pad": "<|tts_pad|>",
}


class Vocabulary:
    """Encode and decode text; the special ids; the ids the model may never say."""

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelDirError(f"{path} is missing: the checkpoint's tokenizer is needed")
        self.tokenizer = Tokenizer.from_file(str(path))
        ids: dict[str, int] = {}
        for field, name in _NAMES.items():
            token = self.tokenizer.token_to_id(name)
            if token is None:
                raise ModelDirError(f"the tokenizer has no {name}: not a MiniCPM-o 4.5 tokenizer")
            ids[field] = token
        self.special = SpecialTokens(**ids)
        config_path = model_dir / "tokenizer_config.json"
        bad: list[int] = []
        if config_path.is_file():
            bad = list(json.loads(config_path.read_text()).get("bad_token_ids", []))
        #: what the reference masks before choosing a word: `<|tts_pad|>` and the
        #: tokenizer's bad ids (`<|chunk_eos|>` is added by the decider)
        self.forbidden: tuple[int, ...] = (self.special.tts_pad, *bad)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Words only: special tokens are left out (as the reference prints a unit)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


__all__ = ["SpecialTokens", "Vocabulary"]
