"""The attention probabilities of chosen cross-attention heads over a processed prompt: one
teacher-forced pass of the model's decoder against its one cross-attended item, outside the
batch (Whisper's alignment heads, read for word timestamps: engine/transcription.py).

The item's keys and values are the encoder cache's entry when it is still there (a window just
decoded left it), else the item is encoded again for this pass alone. Runs on the thread that
steps the engine, between steps (AsyncLLM and LLM call it there): it reads the cache's tensors
and the model's weights, and changes neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.device import to_device
from models.interfaces import CrossAttentionProbe, ProcessedPrompt

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def cross_attention_weights(engine: LLMEngine, processed: ProcessedPrompt,
                            heads: Sequence[tuple[int, int]]) -> np.ndarray:
    """processed: a prompt of T tokens with one cross-attended item of n positions -> the
    probabilities [len(heads), T, n] (float32) of each (decoder layer, head) in `heads`."""
    runner = engine.runner
    model = runner.model
    if not isinstance(model, CrossAttentionProbe):
        raise ValueError(f"model {engine.model_id} does not return cross-attention weights "
                         "(a Whisper checkpoint does)")
    items = [f for f in processed.mm_features if f.cross is not None]
    if len(items) != 1:
        raise ValueError(f"cross-attention weights take a prompt with one cross-attended item, "
                         f"got {len(items)}")
    if len(processed.token_ids) > engine.max_model_len:
        raise ValueError(f"{len(processed.token_ids)} tokens exceed max_model_len="
                         f"{engine.max_model_len}")
    with torch.inference_mode():
        states = runner.encoder_output(items[0])
        ids = to_device(torch.tensor(processed.token_ids, dtype=torch.int64), runner.device)
        return model.alignment_probabilities(ids, states, heads).float().cpu().numpy()
