"""The tiny random Llama the vLLM stage runs on in tests/plugins/vllm and `bench.models --vllm`:
made here from a few sentences (no hub), with the engine settings that fit it.

Needs torch, tokenizers and transformers (the vLLM venv of `make test-vllm`); imported
lazily, so importing this module costs nothing elsewhere.
"""

from __future__ import annotations

CORPUS = [
    "hello world, how are you today?",
    "the quick brown fox jumps over the lazy dog.",
    "what time is it? it is nine o'clock.",
    "repeat after me: one two three four five.",
]


def make_tiny_llama(path) -> None:
    """2 layers, hidden 128, 2 heads / 1 KV head of 64 (vLLM's CPU backend needs head_dim
    64 here), a byte-level BPE tokenizer of 300 tokens trained on a few sentences."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


# EngineSettings for it (services.worker.stages.vllm): small, eager, float32 on the CPU build.
TINY_ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True}
