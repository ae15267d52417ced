"""Speculative decoding: drafters propose the next tokens of running requests, the engine
verifies them in one forward pass beside every other request's work, and only the tokens the
target model itself would have produced are kept (docs/speculative.md). The `speculative` option
itself is parsed in engine/speculative_option.py, which the configuration imports.

- `proposals.py`    per-request bookkeeping: drafts, acceptance, the adapted number of drafts
- `ngram.py`        n-gram lookup in the prompt and the output so far (no weights)
- `draft_model.py`  a small model of the same tokenizer, run by the engine's own runner
- `mtp.py`          Qwen3.5's multi-token-prediction layer (`mtp.*` weights)
- `assistant.py`    Gemma 4's assistant drafter (`Gemma4AssistantForCausalLM`)
- `verify.py`       the verify step's sampling rows and which drafts are accepted
- `rejection.py`    speculative sampling's accept / resample rule for draft distributions
"""
