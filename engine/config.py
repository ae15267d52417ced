"""Engine options: one frozen, validated dataclass.

Values derived at start-up from the model and the device (number of KV blocks, the effective
`max_model_len`) live in `CacheLayout` (see `memory_plan.py`), never written back here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from engine.speculative_option import MAX_SPECULATIVE_TOKENS, SpeculativeMethod

GiB = 1 << 30
QUANTIZATIONS = (None, "int8", "int4")
QUANTIZATION_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8")  # models/layers/kv_quant.py
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _check_range(name: str, value: int | float | None, lo: float, hi: float | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        upper = "inf" if hi is None else hi
        raise ValueError(f"{name} must be in [{lo}, {upper}], got {value}")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine instance.

    Attributes:
        block_size: tokens per KV-cache block (the unit of allocation and of prefix caching).
        kv_cache_bytes: bytes for the paged KV cache of all layers; None = automatic (CPU: up to
            4 GiB and at most a quarter of the memory the host can still give, MemAvailable or
            a cgroup limit's room; CUDA: 85% of free memory after loading the weights), never
            more than `max_num_seqs` full-length sequences need.
        max_num_batched_tokens: token budget of one engine step (decode tokens + prefill chunks).
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence (prompt + output); None = the model's context length,
            or the longest context the KV budget holds (whole blocks) when that is shorter
            (said at start-up); a value the budget does not hold is refused.
        enable_prefix_caching: reuse KV blocks of identical prefixes across requests.
        encoder_cache_size: encoder-output cache capacity, in embeddings (multimodal models
            whose media embeddings are spliced into the prompt).
        max_num_encoder_input_tokens: encoder compute budget of one step, in embeddings.
        processed_cache_items: processed-input cache size, in items (0 disables it).
        quantization: weight-only quantization of the language model's linears at load time
            (the LM head included; embeddings, norms and vision / audio towers stay in the
            model dtype): None, "int8" or "int4", both group-wise. CPU only.
        quantization_group_size: inputs per scale (int8) and per scale and zero (int4): 32, 64
            or 128 (an int8 weight whose inputs the group does not divide: one scale per output
            channel).
        dequantize_gguf: a GGUF checkpoint's blocks are all dequantized as they load (what
            transformers does), instead of its linears running in their ggml blocks as stored
            (CPU); the weights then run at the dtype and `quantization`.
        gguf_activation_digits: a GGUF's linears run as stored (CPU) write their inputs in
            this many int8 digits for the integer products: 2 (each input within max|x| /
            32512: the file's float32 reading to float32 rounding; a prefill through a float32
            GEMM) or 1 (within max|x| / 254 per block, llama.cpp's Q8 activations: half the
            integer work of a decode step and of a verify, and a prefill through the integer
            kernel too, at a measurable cost in the logits: docs/performance.md).
        state_snapshot_bytes: hybrid models (linear-attention layers) only: bytes for prefix
            snapshots of the layers' recurrent state (what a prefix-cache hit restores); None =
            automatic (64 snapshots, at most 1 GiB); 0 = no snapshots (no prefix hits).
        cross_attention_cache_bytes: models with cross-attention layers (Llama 3.2 Vision)
            only: bytes for those layers' keys and values of media items, held by the requests
            that attend to them and cached by content (this replaces `encoder_cache_size` for
            such models); None = automatic (half of the automatic KV-cache budget, taken out
            of it).
        lora_adapters: LoRA adapters requests may choose by name (`SamplingParams.lora`):
            (name, PEFT adapter folder) pairs, or a {name: folder} mapping. Names are letters,
            digits, ".", "_" and "-", at most 64 characters.
        kv_cache_dtype: how the paged KV cache holds keys and values: "auto" (the model
            dtype) or "int8" (each token's row of each KV head as int8 with a float32 scale,
            quantized as it is written; about twice the tokens of a bfloat16 cache in the same
            bytes; cross-attention states and recurrent states stay in the model dtype;
            docs/architecture.md).
        speculative: speculative decoding (docs/speculative.md): "ngram" (the last tokens
            looked up in the prompt and the output so far), "draft:PATH" (a small model of the
            same tokenizer) or "mtp" (the checkpoint's own
            multi-token-prediction layer); None: off. Requests may turn it off or down, or
            choose "ngram" instead (`SamplingParams.num_speculative_tokens`,
            `speculative_method`).
        num_speculative_tokens: the most draft tokens one step verifies per request (1 to
            16); each request's number adapts below it to the drafts' measured acceptance.
    """

    block_size: int = 16
    kv_cache_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 16384
    max_num_encoder_input_tokens: int = 16384
    processed_cache_items: int = 64
    quantization: str | None = None
    quantization_group_size: int = 64
    dequantize_gguf: bool = False
    gguf_activation_digits: int = 2
    state_snapshot_bytes: int | None = None
    cross_attention_cache_bytes: int | None = None
    lora_adapters: tuple[tuple[str, str], ...] = ()
    kv_cache_dtype: str = "auto"
    speculative: str | None = None
    num_speculative_tokens: int = 5

    def __post_init__(self) -> None:
        self._check_adapters()
        if self.speculative is not None:
            SpeculativeMethod.parse(self.speculative)
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(
                self.num_speculative_tokens, int):
            raise ValueError(f"num_speculative_tokens must be an integer, got "
                             f"{self.num_speculative_tokens!r}")
        _check_range("num_speculative_tokens", self.num_speculative_tokens, 1,
                     MAX_SPECULATIVE_TOKENS)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(
                f"block_size must be a power of two in [1, 256], got {self.block_size}"
            )
        _check_range("kv_cache_bytes", self.kv_cache_bytes, 1)
        _check_range("max_num_batched_tokens", self.max_num_batched_tokens, 1, 1 << 20)
        _check_range("max_num_seqs", self.max_num_seqs, 1, 4096)
        _check_range("max_model_len", self.max_model_len, 2, 1 << 24)
        _check_range("encoder_cache_size", self.encoder_cache_size, 1)
        _check_range("max_num_encoder_input_tokens", self.max_num_encoder_input_tokens, 1)
        _check_range("processed_cache_items", self.processed_cache_items, 0)
        _check_range("state_snapshot_bytes", self.state_snapshot_bytes, 0)
        _check_range("cross_attention_cache_bytes", self.cross_attention_cache_bytes, 1)
        for flag in ("enable_prefix_caching", "dequantize_gguf"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.gguf_activation_digits not in (1, 2) or isinstance(
                self.gguf_activation_digits, bool):
            raise ValueError(f"gguf_activation_digits must be 1 or 2, got "
                             f"{self.gguf_activation_digits!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(map(str, QUANTIZATIONS))}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(
                "quantization_group_size must be one of "
                f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}, "
                f"got {self.quantization_group_size!r}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")

    @property
    def speculative_method(self) -> SpeculativeMethod | None:
        """The parsed `speculative` option (None: off)."""
        return None if self.speculative is None else SpeculativeMethod.parse(self.speculative)

    def _check_adapters(self) -> None:
        pairs = self.lora_adapters
        if isinstance(pairs, Mapping):
            pairs = tuple(pairs.items())
        try:
            pairs = tuple((name, str(folder)) for name, folder in pairs)
        except (TypeError, ValueError):
            raise ValueError(f"lora_adapters must be (name, folder) pairs or a mapping, got "
                             f"{self.lora_adapters!r}") from None
        for name, _ in pairs:
            if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
                raise ValueError(f"lora_adapters: name {name!r} must be letters, digits, '.', "
                                 "'_' or '-' (at most 64 characters)")
        names = [name for name, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_adapters: a name repeats in {names}")
        object.__setattr__(self, "lora_adapters", pairs)

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from keyword options, naming any unknown option in the error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
            )
        return cls(**options)  # type: ignore[arg-type]
