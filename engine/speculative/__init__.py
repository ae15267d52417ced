"""Speculative decoding: drafters propose the next tokens of running requests, the engine
verifies them in one forward pass beside every other request's work, and only the tokens the
target model itself would have produced are kept (docs/speculative.md). The `speculative` option
itself is parsed in engine/speculative_option.py, which the configuration imports.

- `ngram.py`        n-gram lookup in the prompt and the output so far (no weights)
- `draft_model.py`  a small model of the same tokenizer, run by the engine's own runner
- `assistant.py`    Gemma 4's assistant drafter (`draft:PATH` to one), reading its target's state
- `mtp.py`          Qwen3.5's multi-token-prediction layer (`mtp.*` weights)
- `drawing.py`      a model drafter's logits to draft tokens (argmax, or a seeded draw)
- `kept_rows.py`    which rows of a finished step a model drafter reads
- `speculator.py`   the engine's side: its drafters, each request's state, the next drafts

What a verification keeps (the verify step's rows, speculative sampling's rule) is
engine/draft_verification.py, below both the runner and the drafters; a request's own
speculation (its drafts, acceptance, the adapted number of drafts) is engine/speculation_state.py,
which the request holds (pure Python).
"""
