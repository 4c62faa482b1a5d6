"""Write the golden token lists: OpenBMB's MiniCPMODuplex run on our tiny checkpoint.

Run in a venv with the reference's transformers (4.51.x) and torch, from the repository root:

    /tmp/golden-venv/bin/python tests/plugins/minicpmo/golden/make_golden.py \\
        --reference /path/to/MiniCPMO45

`--reference` is a directory with the reference's Python files (configuration_minicpmo.py,
modeling_minicpmo.py, modeling_navit_siglip.py, processing_minicpmo.py,
tokenization_minicpmo_fast.py, utils.py of OpenBMB/minicpm-o-4_5-pytorch-simple-demo @ c7e1660);
none of them is in this repository. The script builds the tiny checkpoint with
plugins.minicpmo.builder, copies those files next to it (the checkpoint's config.json points
its auto_map at them), loads MiniCPMODuplex on the CPU and runs every scenario of scenarios.py
greedily, one unit at a time, after a prepare() that feeds the scenario's prompt and, if it
has one, its reference voice. It writes <scenario>.json next to itself and, for debugging our
implementation, per-unit (and reference-voice) tensors under --probes (not committed). README.md
lists what it patches in the reference and why.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import re
import shutil
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]


def _load(name: str, path: Path) -> types.ModuleType:
    """Import one file as a module, without its package: the builder and the scenarios need
    only numpy, torch, safetensors, tokenizers and Pillow, while their packages' __init__
    modules import the project (which this venv does not have)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


builder = _load("minicpmo_builder", REPO / "plugins" / "minicpmo" / "builder.py")
scenarios = _load("minicpmo_golden_scenarios", HERE / "scenarios.py")
SCENARIOS, Scenario = scenarios.SCENARIOS, scenarios.Scenario
decode_frame, unit_digest = scenarios.decode_frame, scenarios.unit_digest
audio_digest = scenarios.audio_digest

BUILDER_SEED = 0
REFERENCE = {
    "repository": "OpenBMB/minicpm-o-4_5-pytorch-simple-demo",
    "commit": "c7e1660",
    "class": "MiniCPMO45/modeling_minicpmo.py:MiniCPMODuplex",
}
REFERENCE_FILES = (
    "configuration_minicpmo.py",
    "modeling_minicpmo.py",
    "modeling_navit_siglip.py",
    "processing_minicpmo.py",
    "tokenization_minicpmo_fast.py",
    "utils.py",
)
STUB_PROMPT_WAV = "stub-prompt.wav"  # handed to the stub vocoder, never read
# The closest greedy call a golden list may hold (logit units): far above the float32 noise
# between two implementations (about 1e-5 here), so the lists hold for any correct one.
MIN_GAP = 0.05


# --- the vocoder stub ------------------------------------------------------------------------


class StubToken2wav:
    """Stands in for stepaudio2.Token2wav (CUDA-only, ONNX assets): the reference only needs its
    lookahead, its stream caches and `stream()`. Records every `stream()` call (the codes the
    reference's buffer hands the vocoder, and whether it is the last chunk) and returns silence
    of the real vocoder's length (960 samples per code past the 3-code lookahead)."""

    def __init__(self) -> None:
        self.flow = types.SimpleNamespace(pre_lookahead_len=3)
        self.cache = None
        self.stream_cache = None
        self.hift_cache_dict: dict = {}
        self.calls: list[tuple[list[int], bool]] = []

    def set_stream_cache(self, prompt_wav: str) -> tuple[dict, dict]:
        return {"flow": torch.zeros(1)}, {"hift": torch.zeros(1)}

    def stream(
        self, tokens: list[int], prompt_wav: str | None = None, last_chunk: bool = False
    ) -> bytes:
        self.calls.append(([int(t) for t in tokens], bool(last_chunk)))
        codes = len(tokens) if last_chunk else max(0, len(tokens) - self.flow.pre_lookahead_len)
        return np.zeros(codes * 960, dtype="<i2").tobytes()


# --- loading the reference -----------------------------------------------------------------


@dataclass
class Reference:
    duplex: object  # MiniCPMODuplex
    module: types.ModuleType  # its modeling_minicpmo
    vocoder: StubToken2wav


def load_reference(reference_dir: Path, model_dir: Path) -> Reference:
    for name in REFERENCE_FILES:
        shutil.copy(reference_dir / name, model_dir / name)

    import transformers.dynamic_module_utils as dynamic_modules

    # transformers refuses remote code whose imports are missing, even guarded or lazy ones:
    # flag_gems (USE_FLAGOS only), librosa and soundfile (reference-audio file loading). None
    # of them runs here.
    dynamic_modules.check_imports = dynamic_modules.get_relative_imports
    model_class = dynamic_modules.get_class_from_dynamic_module(
        "modeling_minicpmo.MiniCPMO", str(model_dir)
    )
    module = importlib.import_module(model_class.__module__)

    vocoder = StubToken2wav()

    def init_tts(self, streaming=False, model_dir=None, enable_float16=False, n_timesteps=10):
        # the original imports stepaudio2 and loads Token2wav on CUDA
        self.tts.config.audio_tokenizer_type = "s3tokenizer_step_audio"
        self.tts.audio_tokenizer = vocoder
        return vocoder

    module.MiniCPMO.init_tts = init_tts

    # MiniCPMODuplex.__init__ casts the model to bfloat16; keep the checkpoint's float32 (a
    # cast back would not restore the rounded bits)
    original_to = module.MiniCPMO.to

    def to_keeping_float32(self, *args, **kwargs):
        args = tuple(a for a in args if a is not torch.bfloat16)
        if kwargs.get("dtype") is torch.bfloat16:
            del kwargs["dtype"]
        return original_to(self, *args, **kwargs)

    module.MiniCPMO.to = to_keeping_float32
    duplex = module.MiniCPMODuplex.from_pretrained(
        str(model_dir), device="cpu", attn_implementation="eager"
    )
    _check_loaded_weights(duplex.model, model_dir)
    return Reference(duplex, module, vocoder)


def _check_loaded_weights(model: torch.nn.Module, model_dir: Path) -> None:
    """Every parameter is the checkpoint's, bit for bit, and nothing was left to random init."""
    from safetensors.torch import load_file

    stored = load_file(str(model_dir / "model.safetensors"))
    loaded = model.state_dict()
    missing = sorted(set(loaded) - set(stored))
    unused = sorted(set(stored) - set(loaded))
    if missing or unused:
        raise SystemExit(f"checkpoint/model mismatch: missing {missing}, unused {unused}")
    for name, tensor in stored.items():
        if loaded[name].dtype != torch.float32 or not torch.equal(loaded[name], tensor):
            raise SystemExit(f"{name} is not the checkpoint's float32 value after loading")


# --- recording -------------------------------------------------------------------------------


@dataclass
class UnitTrace:
    """What the hooks saw during one unit."""

    mel: list[np.ndarray] = field(default_factory=list)
    audio_embeds: list[np.ndarray] = field(default_factory=list)
    frames: list[dict[str, np.ndarray]] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    tts_conditions: list[np.ndarray] = field(default_factory=list)
    tts_logits: list[np.ndarray] = field(default_factory=list)
    tts_codes: list[list[int]] = field(default_factory=list)


def _margin(values: torch.Tensor) -> float:
    """First minus second largest finite value."""
    finite = values[torch.isfinite(values)]
    top = torch.topk(finite, 2).values
    return float(top[0] - top[1])


def _scale(values: torch.Tensor) -> float:
    """The spread of a logit vector (std of its finite entries): what a margin is measured by."""
    return float(values[torch.isfinite(values)].std())


@contextmanager
def _patched(owner: object, name: str, replacement: Callable) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextmanager
def hooks(ref: Reference, trace: Callable[[], UnitTrace]) -> Iterator[None]:
    """Observe the reference during a run; every hook calls through to the original. The only
    change of behaviour: torch.multinomial takes the most likely code (the TTS has no greedy
    mode; the LLM's greedy decoder never calls it)."""
    duplex, model, module = ref.duplex, ref.duplex.model, ref.module
    chunk_eos = duplex.chunk_eos_token_id

    original_decode = duplex.decoder.decode
    original_argmax = torch.argmax

    def decode(logits, *args, **kwargs):
        # greedy decode() calls argmax twice: on the raw logits (is it <|chunk_eos|>?), then,
        # unless it was, on the masked and penalised logits
        seen: list[torch.Tensor] = []

        def argmax(tensor, *a, **k):
            seen.append(tensor.detach().clone().reshape(-1))
            return original_argmax(tensor, *a, **k)

        with _patched(torch, "argmax", argmax):
            token = original_decode(logits, *args, **kwargs)
        raw = seen[0]
        others = torch.cat([raw[:chunk_eos], raw[chunk_eos + 1 :]])
        trace().decisions.append(
            {
                "returned": int(token.item()),
                "raw_logits": raw.numpy(),
                "chunk_eos_gap": float(raw[chunk_eos] - others.max()),
                "gap": _margin(seen[1]) if len(seen) > 1 else None,
                "scale": _scale(raw),
            }
        )
        return token

    original_audio = model.get_audio_embedding_streaming

    def audio_embedding(data, *args, **kwargs):
        out = original_audio(data, *args, **kwargs)
        trace().mel.append(data["audio_features"][0].detach().numpy().copy())
        trace().audio_embeds.append(torch.cat([t for g in out for t in g]).detach().numpy())
        return out

    original_vision = model.get_vision_embedding

    def vision_embedding(data):
        out = original_vision(data)
        embeds = out[0]
        for i, pixels in enumerate(data["pixel_values"][0]):
            trace().frames.append(
                {
                    "pixels": np.asarray(
                        pixels.detach().numpy() if torch.is_tensor(pixels) else pixels
                    ),
                    "tgt_size": np.asarray(data["tgt_sizes"][0][i]),
                    "embeds": embeds[i].detach().numpy().copy(),
                }
            )
        return out

    original_condition = duplex._convert_results_to_tts_input

    def tts_condition(results):
        out = original_condition(results)
        trace().tts_conditions.append(out[0].detach().numpy().copy())
        return out

    original_chunk = model.tts.generate_chunk
    in_tts = [False]

    def generate_chunk(*args, **kwargs):
        in_tts[0] = True
        try:
            tokens, kv = original_chunk(*args, **kwargs)
        finally:
            in_tts[0] = False
        trace().tts_codes.append([int(t) for t in tokens.reshape(-1)])
        return tokens, kv

    real_functional = module.F

    class Functional:
        """modeling_minicpmo's `F`, recording the TTS logits that reach the code softmax."""

        def __getattr__(self, name):
            return getattr(real_functional, name)

        @staticmethod
        def softmax(x, *args, **kwargs):
            if in_tts[0]:
                trace().tts_logits.append(x.detach().reshape(-1).numpy().copy())
            return real_functional.softmax(x, *args, **kwargs)

    def multinomial(probs, num_samples, *args, **kwargs):
        return original_argmax(probs, dim=-1, keepdim=True)

    with (
        _patched(duplex.decoder, "decode", decode),
        _patched(model, "get_audio_embedding_streaming", audio_embedding),
        _patched(model, "get_vision_embedding", vision_embedding),
        _patched(duplex, "_convert_results_to_tts_input", tts_condition),
        _patched(model.tts, "generate_chunk", generate_chunk),
        _patched(module, "F", Functional()),
        _patched(torch, "multinomial", multinomial),
    ):
        yield


# --- the session prompt ----------------------------------------------------------------------


@dataclass
class PromptTrace:
    """What prepare() fed: the reference voice's log-mel (the feature extractor's whole output,
    30 s padded, and the frames kept), its embeddings, and the decoder's length afterwards."""

    mel_padded: list[np.ndarray] = field(default_factory=list)
    mel: list[np.ndarray] = field(default_factory=list)
    mel_lengths: list[np.ndarray] = field(default_factory=list)
    embeds: list[np.ndarray] = field(default_factory=list)
    positions: int = 0


def prepare_session(ref: Reference, scenario: Scenario) -> PromptTrace:
    """reset_session() and prepare() as the demo calls it, recording the reference voice's path
    (observation only: every hook calls through unchanged)."""
    duplex, model = ref.duplex, ref.duplex.model
    extractor = duplex.processor.audio_processor
    # The streaming mel processor shares this feature extractor and switches its log floor (a
    # fixed -10 under 5 s of buffered audio, max - 8 from 5 s on), and prepare() does not
    # switch it back: the reference voice's mel takes whatever the previous session left. A
    # fresh process has max - 8 (the constructor's default), and so does any session after
    # one that buffered 5 s or more (all of ours); the lists are made with that.
    if scenario.ref_audio is not None and (
        duplex.processor is not model.processor
        or not (extractor.dynamic_log_norm and extractor.dynamic_range_db == 8.0)
    ):
        raise SystemExit(f"{scenario.name}: the reference voice's mel floor is not max - 8")
    trace = PromptTrace()
    original_embedding = model.get_audio_embedding
    original_fbank = extractor._torch_extract_fbank_features

    def audio_embedding(data, *args, **kwargs):
        out = original_embedding(data, *args, **kwargs)
        trace.mel.append(data["audio_features"][0].detach().numpy().copy())
        trace.mel_lengths.append(torch.hstack(data["audio_feature_lens"]).numpy().copy())
        trace.embeds.append(torch.cat([t for g in out for t in g]).detach().numpy())
        return out

    def fbank(waveform, *args, **kwargs):
        out = original_fbank(waveform, *args, **kwargs)
        trace.mel_padded.append(np.asarray(out)[0].copy())
        return out

    model.reset_session()  # prepare() keeps the Whisper KV of an earlier session
    with (
        _patched(model, "get_audio_embedding", audio_embedding),
        _patched(extractor, "_torch_extract_fbank_features", fbank),
    ):
        duplex.prepare(
            prefix_system_prompt=scenario.prefix,
            suffix_system_prompt=scenario.suffix,
            ref_audio=scenario.ref_audio,
            prompt_wav_path=STUB_PROMPT_WAV,
        )
    trace.positions = duplex.decoder.get_cache_length()
    voices = 0 if scenario.ref_audio is None else 1
    if len(trace.embeds) != voices or len(trace.mel_padded) != voices:
        raise SystemExit(f"{scenario.name}: prepare() ran the reference voice's path otherwise")
    return trace


def prompt_record(ref: Reference, scenario: Scenario, trace: PromptTrace) -> dict:
    """The prompt's ids and, with a reference voice, what the reference made of it."""
    tokenizer = ref.duplex.tokenizer
    prefix_ids = tokenizer.encode(scenario.prefix, add_special_tokens=False)
    suffix_ids = tokenizer.encode(scenario.suffix, add_special_tokens=False)
    record = {
        "prefix": scenario.prefix,
        "suffix": scenario.suffix,
        "prefix_ids": prefix_ids,
        "suffix_ids": suffix_ids,
    }
    if scenario.ref_audio is None:
        if trace.positions != len(prefix_ids) + len(suffix_ids):
            raise SystemExit(f"{scenario.name}: the prompt is not its prefix and suffix ids")
        return record  # the lists made before reference voices had no more
    embeddings = trace.embeds[0].shape[0]
    if trace.positions != len(prefix_ids) + embeddings + len(suffix_ids):
        raise SystemExit(f"{scenario.name}: the prompt is not prefix, voice and suffix")
    # a fingerprint of the voice's path, for a parity test to compare without the probes: the
    # frames' means show a wrong floor or padding, the embeddings' norms a wrong chunk mask
    mel, embeds = trace.mel[0], trace.embeds[0]
    record["ref_audio"] = {
        "samples": int(scenario.ref_audio.shape[0]),
        "sha256": audio_digest(scenario.ref_audio),
        "mel_frames": int(trace.mel_lengths[0][0]),
        "mel_floor": "max - 8 (log10) over the 30 s zero-padded log-mel, then (x + 4) / 4",
        "mel_range": [_round(float(mel.min())), _round(float(mel.max()))],
        "mel_frame_means": [_round(float(x)) for x in mel.mean(axis=0, dtype=np.float64)],
        "chunk_length_s": float(ref.duplex.model.config.audio_chunk_length),
        "embeddings": int(embeddings),
        "embedding_norms": [
            _round(float(x)) for x in np.linalg.norm(embeds.astype(np.float64), axis=1)
        ],
    }
    record["positions"] = trace.positions
    return record


def _write_prompt_probes(path: Path, trace: PromptTrace) -> None:
    if not trace.embeds:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        mel_padded=trace.mel_padded[0],
        mel=trace.mel[0],
        mel_lengths=trace.mel_lengths[0],
        embeds=trace.embeds[0],
        positions=np.asarray(trace.positions),
    )


# --- a run -----------------------------------------------------------------------------------

KIND_SAMPLED = "sampled"
KIND_REPLACED = "listen_replaced"  # a sampled <|listen|> fed as <|tts_bos|> (turn not over)
KIND_FORCED = "forced_chunk_eos"  # the 20th position of a unit
KIND_UNIT_END = "unit_end"


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.6g}")


def run_scenario(
    ref: Reference, scenario: Scenario, probes: Path | None
) -> tuple[dict, list[dict]]:
    """The scenario's prompt record and its units."""
    duplex = ref.duplex
    tokenizer = duplex.tokenizer
    unit_trace = UnitTrace()
    prompt_trace = prepare_session(ref, scenario)
    prompt = prompt_record(ref, scenario, prompt_trace)
    if probes is not None:
        _write_prompt_probes(probes / scenario.name / "prompt.npz", prompt_trace)
    units = []
    with hooks(ref, lambda: unit_trace):
        for index, unit in enumerate(scenario.units):
            unit_trace = UnitTrace()
            ref.vocoder.calls.clear()
            fed_before = len(duplex.total_ids)
            frames = [decode_frame(jpeg) for jpeg in unit.frames]
            prefill = duplex.streaming_prefill(
                audio_waveform=unit.audio, frame_list=frames or None, max_slice_nums=1
            )
            if not prefill["success"]:
                raise SystemExit(f"{scenario.name} unit {index}: prefill failed: {prefill}")
            result = duplex.streaming_generate(
                prompt_wav_path=STUB_PROMPT_WAV, decode_mode="greedy"
            )
            units.append(
                _unit_record(
                    index,
                    unit,
                    frames,
                    result,
                    duplex.total_ids[fed_before:],
                    unit_trace,
                    ref.vocoder.calls,
                    tokenizer,
                )
            )
            if probes is not None:
                _write_probes(probes / scenario.name / f"unit_{index:02d}.npz", unit_trace)
    return prompt, units


def _unit_record(
    index, unit, frames, result, fed, trace: UnitTrace, vocoder_calls, tokenizer
) -> dict:
    unit_end = tokenizer.convert_tokens_to_ids("</unit>")
    assert fed[-1] == unit_end, fed
    kinds = []
    for k, token in enumerate(fed[:-1]):
        if k < len(trace.decisions):
            kinds.append(KIND_SAMPLED if trace.decisions[k]["returned"] == token else KIND_REPLACED)
        else:
            kinds.append(KIND_FORCED)
    kinds.append(KIND_UNIT_END)
    tts_margins = [
        (_margin(torch.from_numpy(x)), _scale(torch.from_numpy(x))) for x in trace.tts_logits
    ]
    return {
        "index": index,
        "input_sha256": unit_digest(unit),
        "frames": [list(frame.size) for frame in frames],
        "listen": bool(result["is_listen"]),
        "end_of_turn": bool(result["end_of_turn"]),
        "ids": [int(t) for t in fed],
        "kinds": kinds,
        "text": result["text"],
        "codes": trace.tts_codes[0] if trace.tts_codes else None,
        "vocoder_calls": [{"codes": codes, "last": last} for codes, last in vocoder_calls],
        "decisions": [
            [_round(d["chunk_eos_gap"]), _round(d["gap"]), _round(d["scale"])]
            for d in trace.decisions
        ],
        "tts_margins": [[_round(m), _round(scale)] for m, scale in tts_margins],
    }


def _write_probes(path: Path, trace: UnitTrace) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    if trace.mel:
        arrays["mel"] = trace.mel[0]
        arrays["audio_embeds"] = trace.audio_embeds[0]
    for i, frame in enumerate(trace.frames):
        arrays[f"frame{i}_pixels"] = frame["pixels"]
        arrays[f"frame{i}_tgt_size"] = frame["tgt_size"]
        arrays[f"frame{i}_embeds"] = frame["embeds"]
    if trace.decisions:
        arrays["decision_logits"] = np.stack([d["raw_logits"] for d in trace.decisions])
    if trace.tts_conditions:
        arrays["tts_condition"] = trace.tts_conditions[0]
    if trace.tts_logits:
        arrays["tts_logits"] = np.stack(trace.tts_logits)
    np.savez_compressed(path, **arrays)


# --- summaries and output --------------------------------------------------------------------


def coverage(units: list[dict], ids: dict[str, int]) -> dict[str, int]:
    """How many units (or tokens) show each duplex behaviour."""

    def count(predicate) -> int:
        return sum(1 for unit in units if predicate(unit))

    def last_generated(unit) -> int:
        return unit["ids"][-2]

    return {
        "units": len(units),
        "listen_units": count(lambda u: u["listen"]),
        "speak_units": count(lambda u: not u["listen"]),
        "forced_chunk_eos_units": count(lambda u: KIND_FORCED in u["kinds"]),
        "model_chunk_eos_units": count(
            lambda u: last_generated(u) == ids["<|chunk_eos|>"] and KIND_FORCED not in u["kinds"]
        ),
        "chunk_tts_eos_units": count(lambda u: last_generated(u) == ids["<|chunk_tts_eos|>"]),
        "turn_eos_units": count(lambda u: ids["<|turn_eos|>"] in u["ids"]),
        "listen_after_turn_eos_units": count(
            lambda u: u["listen"] and ids["<|turn_eos|>"] in u["ids"]
        ),
        "listen_replaced_tokens": sum(u["kinds"].count(KIND_REPLACED) for u in units),
        "text_units": count(lambda u: bool(u["text"])),
        "tts_units": count(lambda u: u["codes"] is not None),
        "tts_short_units": count(lambda u: u["codes"] is not None and len(u["codes"]) < 25),
        "tts_empty_units": count(lambda u: u["codes"] == []),
        "frame_units": count(lambda u: bool(u["frames"])),
    }


def minimum_margins(units: list[dict]) -> dict[str, float | None]:
    """The closest calls of the run: absolute (logit units) and relative to the logits' std."""
    decisions = [d for u in units for d in u["decisions"]]
    final = [(d[1], d[2]) for d in decisions if d[1] is not None]
    tts = [m for u in units for m in u["tts_margins"]]
    return {
        "llm_decisions": len(decisions),
        "llm_gap": min((gap for gap, _ in final), default=None),
        "llm_gap_relative": _round(min((gap / scale for gap, scale in final), default=None)),
        "llm_chunk_eos_gap": min((abs(d[0]) for d in decisions), default=None),
        "llm_chunk_eos_gap_relative": _round(
            min((abs(d[0]) / d[2] for d in decisions), default=None)
        ),
        "tts_decisions": len(tts),
        "tts_gap": min((gap for gap, _ in tts), default=None),
        "tts_gap_relative": _round(min((gap / scale for gap, scale in tts), default=None)),
    }


def versions() -> dict[str, str]:
    packages = (
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "accelerate",
        "huggingface_hub",
        "numpy",
        "pillow",
    )
    return {
        "python": platform.python_version(),
        **{name: importlib.metadata.version(name) for name in packages},
    }


def golden_document(
    ref: Reference, scenario: Scenario, prompt: dict, units: list[dict], seed: int
) -> dict:
    tokenizer = ref.duplex.tokenizer
    names = (
        "<unit>",
        "</unit>",
        "<image>",
        "</image>",
        "<|listen|>",
        "<|speak|>",
        "<|tts_bos|>",
        "<|chunk_eos|>",
        "<|chunk_tts_eos|>",
        "<|turn_eos|>",
        "<|tts_pad|>",
        "<|im_end|>",
    )
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in names}
    return {
        "scenario": scenario.name,
        "reference": REFERENCE,
        "builder_seed": seed,
        "versions": versions(),
        "settings": {
            "device": "cpu",
            "dtype": "float32",
            "attn_implementation": "eager",
            "decode_mode": "greedy",
            "tts_sampling": "argmax in place of torch.multinomial",
            "max_slice_nums": 1,
            "sliding_window_mode": "off",
            "force_listen_count": 0,
            "max_new_speak_tokens_per_chunk": 20,
            "text_repetition_penalty": 1.05,
            "tts_temperature": 0.8,
            "tts_repetition_penalty": 1.05,
        },
        "prompt": prompt,
        "special_ids": ids,
        "coverage": coverage(units, ids),
        "minimum_margins": minimum_margins(units),
        "unit_fields": {
            "ids": "every LLM input id after the unit's prefill, in order (</unit> last)",
            "kinds": f"per id: {KIND_SAMPLED}, {KIND_REPLACED}, {KIND_FORCED}, {KIND_UNIT_END}",
            "codes": "the speech codes generate_chunk returned (null: the TTS did not run)",
            "vocoder_calls": "the codes the reference handed Token2wav.stream, per call",
            "decisions": "per decode() call: [raw <|chunk_eos|> logit minus the best other "
            "(negative: not chosen), first minus second of the final logits "
            "(null: stage 0 chose <|chunk_eos|>), std of the raw logits]",
            "tts_margins": "per generate_chunk step: [first minus second of the logits its "
            "code was drawn from (after temperature, penalty and EOS mask), their std]; the "
            "last step's code is dropped (EOS, or the 26th)",
        },
        "units": units,
    }


def write_json(path: Path, document: dict) -> None:
    """Indented, with each unit field on one line, so a diff shows which unit and field moved."""
    head = {key: value for key, value in document.items() if key != "units"}
    text = json.dumps(head, indent=2, ensure_ascii=False)[:-2]  # reopen the closing brace
    # lists of numbers (the prompt's ids) on one line too
    text = re.sub(
        r"\[\s*(-?[0-9][0-9.e+-]*(?:,\s*-?[0-9][0-9.e+-]*)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    units = []
    for unit in document["units"]:
        fields = ",\n".join(
            f"      {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"
            for key, value in unit.items()
        )
        units.append("    {\n" + fields + "\n    }")
    text += ',\n  "units": [\n' + ",\n".join(units) + "\n  ]\n}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reference",
        type=Path,
        required=True,
        help="directory holding the reference's MiniCPMO45 Python files",
    )
    parser.add_argument("--seed", type=int, default=BUILDER_SEED, help="the builder's seed")
    parser.add_argument("--out", type=Path, default=HERE, help="where the JSON files go")
    parser.add_argument(
        "--probes",
        default="/tmp/minicpmo-golden/probes",
        help="where the per-unit tensors go ('' for none)",
    )
    parser.add_argument(
        "--min-gap",
        type=float,
        default=MIN_GAP,
        help="refuse to write lists with a closer call than this (logit units)",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="run only these (default: all)",
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)  # nothing should draw from it; fixed anyway
    torch.set_num_threads(1)
    probes = Path(args.probes) if args.probes else None
    with tempfile.TemporaryDirectory(prefix="minicpmo-tiny-") as tmp:
        model_dir = builder.build_tiny_checkpoint(Path(tmp) / "model", seed=args.seed)
        ref = load_reference(args.reference, model_dir)
        for name in args.scenario or list(SCENARIOS):
            scenario = SCENARIOS[name]()
            prompt, units = run_scenario(ref, scenario, probes)
            document = golden_document(ref, scenario, prompt, units, args.seed)
            print(name, json.dumps(document["coverage"]), json.dumps(document["minimum_margins"]))
            margins = document["minimum_margins"]
            closest = min(
                m
                for m in (margins["llm_gap"], margins["llm_chunk_eos_gap"], margins["tts_gap"])
                if m is not None
            )
            if closest < args.min_gap:
                raise SystemExit(f"{name}: a greedy choice within {closest} of its runner-up")
            write_json(args.out / f"{name}.json", document)


if __name__ == "__main__":
    main()
