"""A tiny random Moshi-architecture checkpoint directory, built with moshi's own classes.

The LM is an `LMModel` (2 layers, dim 32, a 1-layer depformer, 2 model and 2 user audio
codebooks of 32 entries, the text stream with its acoustic delays), Mimi is `MimiModel` built
by `loaders.get_mimi` from moshi's default config with small overrides (the SEANet ratios are
kept, so one frame is still 1920 samples at 24 kHz, 12.5 Hz), and the text tokenizer is a
sentencepiece model trained here on a few sentences. Weights are random with a fixed seed.
The directory is laid out as the Hugging Face repos are, with a `config.json` carrying the LM
kwargs and our `"mimi"` overrides, and the plugin loads it through its real loading code.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch, moshi and sentencepiece live in .venv-moshi only: they are imported where used, so
# the main venv can import harness (and bench/tick_batched can tell whether they exist)

SENTENCES = [
    "hello there how are you today",
    "i am fine thank you and you",
    "the weather is nice and sunny",
    "what would you like to talk about",
    "tell me a story about a small robot",
    "the robot walked to the market to buy bread",
    "good morning good evening good night",
    "numbers one two three four five six seven eight nine ten",
]

#: Mimi: moshi's default config, small (the overrides go in config.json under "mimi")
TINY_MIMI: dict[str, Any] = {
    "seanet": {"dimension": 16, "n_filters": 2},
    "quantizer": {
        "dimension": 8,
        "n_q": 2,
        "bins": 32,
        "input_dimension": 16,
        "output_dimension": 16,
    },
    "transformer": {
        "d_model": 16,
        "num_heads": 2,
        "num_layers": 1,
        "dim_feedforward": 32,
        "context": 20,
        "input_dimension": 16,
        "output_dimensions": [16],
    },
}

#: the LM: moshi's 7B layout in miniature (text + 2 model + 2 user codebooks)
TINY_LM: dict[str, Any] = {
    "dim": 32,
    "existing_text_padding_id": 3,
    "n_q": 4,
    "dep_q": 2,
    "card": 32,
    "num_heads": 2,
    "num_layers": 2,
    "hidden_scale": 2,
    "causal": True,
    "layer_scale": None,
    "context": 100,
    "max_period": 10000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 16,
    "depformer_dim_feedforward": 32,
    "depformer_num_heads": 2,
    "depformer_num_layers": 1,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 2,
    "depformer_max_period": 10000,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 1, 0, 1],
}


def train_tokenizer(path: Path) -> int:
    """A sentencepiece model of `SENTENCES` at `path`; returns its vocabulary size."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES),
        model_writer=model,
        vocab_size=60,
        model_type="bpe",
        hard_vocab_limit=False,
        # moshi's convention: 0 unk/end-of-padding, 3 padding; bos/eos as in kyutai's model
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return sentencepiece.SentencePieceProcessor(model_file=str(path)).vocab_size()


def _randomize_quantizer(mimi: torch.nn.Module, generator: torch.Generator) -> None:
    """moshi's codebooks start as zeros (k-means fills them in training): random ones here,
    so that different audio gets different codes."""
    import torch

    for name, buffer in mimi.named_buffers():
        if name.endswith("embedding_sum"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
        elif name.endswith("_initialized"):
            buffer.fill_(1.0)


def make_tiny_moshi(directory: Path, seed: int = 1234, **config_extra: Any) -> Path:
    """Write the tiny checkpoint into `directory` (created) and return it."""
    import torch
    from moshi.models import loaders
    from safetensors.torch import save_file

    from plugins.moshi.checkpoint import MIMI_OVERRIDES_KEY, deep_merge

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text_card = train_tokenizer(directory / loaders.TEXT_TOKENIZER_NAME)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    lm_kwargs = {**TINY_LM, "text_card": text_card}
    lm = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs, device="cpu", dtype=torch.float32)
    save_file(
        {k: v.contiguous() for k, v in lm.state_dict().items()}, directory / loaders.MOSHI_NAME
    )
    mimi_config = deep_merge(loaders._mimi_config, TINY_MIMI)
    mimi = loaders.get_mimi(
        None, mimi_config, device="cpu", num_codebooks=TINY_MIMI["quantizer"]["n_q"]
    )
    with torch.no_grad():
        _randomize_quantizer(mimi, generator)
    save_file(
        {k: v.contiguous() for k, v in mimi.state_dict().items()}, directory / loaders.MIMI_NAME
    )
    config = {**lm_kwargs, MIMI_OVERRIDES_KEY: TINY_MIMI, **config_extra}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


__all__ = ["SENTENCES", "TINY_LM", "TINY_MIMI", "make_tiny_moshi", "train_tokenizer"]
