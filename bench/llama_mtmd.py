"""Bench-only: llama.cpp's multimodal path (libmtmd, through llama-cpp-python's bindings) run one
stage at a time, for bench.media_turn.

A turn is what llama.cpp's own tools do with a picture or a sound: the file (an image, or a
WAV / MP3 / FLAC) decoded into a bitmap, `mtmd_tokenize` (the prompt's text tokenized, the image
resized and normalized, or the sound's mel spectrogram, into its chunk), then chunk by chunk:
text through `llama_decode`, the media through its tower (`mtmd_encode_chunk`) and its
embeddings through the decoder (`mtmd_helper_decode_image_chunk`, which takes audio chunks
too), the first token greedy from the last logits, then greedy decode steps. A second turn
either keeps the first turn's KV cache and decodes only the new text (as llama-server does), or
starts again from the rendered conversation (as llama-cpp-python's chat handler does: the
media encoded again).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def build_features() -> str:
    """The instruction sets the imported llama.cpp was built for ("SSE3 AVX AVX2 FMA ..."), from
    its system info ("CPU : SSE3 = 1 | AVX = 1 | ... | OPENMP = 1 |")."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode().replace("CPU :", "|")
    on = [part.split("=")[0].strip() for part in info.split("|") if part.strip().endswith("= 1")]
    isa = [name for name in on if name not in ("LLAMAFILE", "OPENMP", "REPACK")]
    return " ".join(isa) or "none (its portable x86-64 build)"


@dataclass
class LlamaTurn:
    """Seconds per stage of one turn, and the prompt it saw."""

    load: float = 0.0  # media file -> bitmap
    preprocess: float = 0.0  # mtmd_tokenize: text tokens, media resized / mel features
    encode: float = 0.0  # the vision or audio tower
    prefill: float = 0.0  # the decoder over text and media embeddings
    ttft: float = 0.0  # from the media file to the first token
    decode_rate: float = 0.0  # tokens/s after the first
    # The prompt as llama.cpp laid it out: text token ids, -1 for each media position.
    prompt: list[int] = field(default_factory=list)
    media_tokens: int = 0


class LlamaMtmd:
    """A text GGUF and its `mmproj` GGUF loaded into one llama.cpp context."""

    def __init__(self, text_gguf: Path, mmproj: Path, threads: int, context: int) -> None:
        import llama_cpp
        import llama_cpp.mtmd_cpp as mtmd

        self.lib, self.mtmd = llama_cpp, mtmd
        # libmtmd logs every chunk it adds and encodes to stderr: silenced (kept referenced).
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
        mtmd.mtmd_helper_log_set(self._quiet, None)
        self.llm = llama_cpp.Llama(str(text_gguf), n_ctx=context, n_threads=threads,
                                   n_threads_batch=threads, n_batch=2048, n_ubatch=512,
                                   verbose=False)
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = threads
        params.print_timings = False
        self.ctx = mtmd.mtmd_init_from_file(str(mmproj).encode(), self.llm._model.model, params)
        if not self.ctx:
            raise RuntimeError(f"libmtmd could not load {mmproj}")
        self.marker = mtmd.mtmd_default_marker().decode()
        self.vocab = self.llm.n_vocab()

    def close(self) -> None:
        if self.ctx:
            self.mtmd.mtmd_free(self.ctx)
            self.ctx = None

    def turn(self, media: bytes, text: str, new_tokens: int, keep: bool = False) -> LlamaTurn:
        """One turn: `text` holds the media marker where the media file `media` goes (rendered
        with the model's chat template). `keep`: decode after what the context already holds
        (only the text past it is new: `text` is then the new text alone and `media` may be
        empty); else the context is cleared first."""
        mtmd, out = self.mtmd, LlamaTurn()
        t0 = time.perf_counter()
        bitmaps = []
        if media:
            buf = (ctypes.c_uint8 * len(media)).from_buffer(bytearray(media))
            bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(media), False)
            if not bitmap:
                raise RuntimeError("libmtmd could not decode the media file")
            bitmaps.append(bitmap)
        out.load = time.perf_counter() - t0
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            t1 = time.perf_counter()
            data = text.encode()
            inp = mtmd.mtmd_input_text()
            inp.text, inp.text_len = data, len(data)
            inp.add_special, inp.parse_special = False, True
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            if mtmd.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), array, len(bitmaps)):
                raise RuntimeError("mtmd_tokenize failed")
            out.preprocess = time.perf_counter() - t1
            if not keep:
                self.llm.reset()
                self.llm._ctx.kv_cache_clear()
            self._eval_chunks(chunks, out)
            token = self._argmax()
            out.ttft = time.perf_counter() - t0
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
        t2 = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([token])
            token = self._argmax()
        if new_tokens > 1:
            out.decode_rate = (new_tokens - 1) / (time.perf_counter() - t2)
        return out

    def _eval_chunks(self, chunks, out: LlamaTurn) -> None:
        mtmd, llm = self.mtmd, self.llm
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            kind = mtmd.mtmd_input_chunk_get_type(chunk)
            if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t()
                ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                tokens = [ptr[j] for j in range(n.value)]
                out.prompt += tokens
                t0 = time.perf_counter()
                llm.eval(tokens)
                out.prefill += time.perf_counter() - t0
                continue
            n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            out.prompt += [-1] * n_tokens
            out.media_tokens += n_tokens
            t0 = time.perf_counter()
            if mtmd.mtmd_encode_chunk(self.ctx, chunk):
                raise RuntimeError("mtmd_encode_chunk failed")
            t1 = time.perf_counter()
            new_past = self.lib.llama_pos(0)
            if mtmd.mtmd_helper_decode_image_chunk(
                    self.ctx, llm._ctx.ctx, chunk, mtmd.mtmd_get_output_embd(self.ctx),
                    self.lib.llama_pos(llm.n_tokens), self.lib.llama_seq_id(0), llm.n_batch,
                    ctypes.byref(new_past), mtmd.mtmd_helper_post_decode_callback(), None):
                raise RuntimeError("mtmd_helper_decode_image_chunk failed")
            t2 = time.perf_counter()
            out.encode += t1 - t0
            out.prefill += t2 - t1
            llm.n_tokens = new_past.value  # positions past the media (mRoPE: not its length)

    def _argmax(self) -> int:
        logits = self.lib.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.vocab,))))
