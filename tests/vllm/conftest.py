"""A tiny random Llama made here (no hub), and one vLLM engine for the module.

Runs only where vLLM is installed (`make test-vllm` builds `.venv-vllm` with the CPU build);
tests/conftest.py leaves this folder out elsewhere.
"""

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest
import pytest_asyncio

from services.worker.stages.vllm import EngineSettings, build_engine

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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(path)
    return str(path)


TINY_ENGINE = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": True}


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def engine(tiny_llama):
    engine = build_engine(EngineSettings(tiny_llama, **TINY_ENGINE))
    yield engine
    engine.shutdown()
    del engine
    gc.collect()  # AsyncLLM.__del__ now, not at interpreter exit with its modules half gone
