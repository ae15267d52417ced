"""Token timestamps from the alignment heads' cross-attention (numpy, no torch), as
transformers' `_extract_token_timestamps` computes them:

- the probabilities [heads, rows, keys] of the window's rows (one per token fed: the prompt,
  then every generated token but the last) are cut to the encoder positions the audio covers
  (`frames // 2`: a short window's zero padding is left out);
- the prompt's rows are dropped (its tokens sit at 0 s);
- each head's weights are standardized along the tokens (mean 0, population std 1) at every
  encoder position, median-filtered along the positions (the config's `median_filter_width`,
  7 by default; edges reflected), and averaged over the heads;
- dynamic time warping finds the cheapest monotone path through the negated matrix; the
  encoder position where the path first reaches a row is that row's time (0.02 s a position).

The row of generated token k is the query at token k (it predicts token k + 1), so the time of
token k is where the audio of the token after it begins; the last generated token (the end
token, usually) repeats the time before it. A word then spans from the time of the token
before its first token (0 for the first generated token) to that of its last token, as
transformers' pipeline reads them (models/whisper/words.py groups the tokens).

One departure: an encoder position where every token has the same weight (std 0, as happens
when a head's softmax underflows to exactly 0 there) standardizes to 0 here, where transformers
divides by zero and its path runs through NaN.
"""

from __future__ import annotations

import numpy as np

SECONDS_PER_POSITION = 0.02  # one encoder position: two 10 ms mel frames
MEDIAN_FILTER_WIDTH = 7  # WhisperConfig's default median_filter_width


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """The median of each `width` values along the last axis, the edges reflected (an axis no
    longer than width // 2 is returned as is)."""
    if width <= 0 or width % 2 != 1:
        raise ValueError(f"median_filter_width must be an odd positive number, got {width}")
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return np.sort(windows, axis=-1)[..., pad]


def dynamic_time_warping(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest path through `matrix` [rows, cols] from (0, 0) to the last cell, moving
    down, right or diagonally: (row indices, column indices) along it. Costs add in float32 as
    transformers' and openai-whisper's loops store them; ties go right, as theirs do (a
    diagonal or a down move is taken only when strictly cheaper than both others)."""
    rows, cols = matrix.shape
    cost = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    trace = np.full((rows + 1, cols + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    # Cells (i, j) with i + j = d depend only on the two diagonals before: one numpy pass each.
    for d in range(2, rows + cols + 1):
        i = np.arange(max(1, d - cols), min(rows, d - 1) + 1)
        j = d - i
        c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        diagonal = (c0 < c1) & (c0 < c2)
        down = ~diagonal & (c1 < c0) & (c1 < c2)
        step = np.where(diagonal, 0, np.where(down, 1, 2)).astype(np.int8)
        best = np.where(diagonal, c0, np.where(down, c1, c2))
        cost[i, j] = (matrix[i - 1, j - 1] + best.astype(np.float64)).astype(np.float32)
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = rows, cols
    text, time = [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        move = trace[i, j]
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text[::-1]), np.array(time[::-1])


def token_times(probabilities: np.ndarray, prompt_len: int, frames: int,
                filter_width: int = MEDIAN_FILTER_WIDTH) -> np.ndarray:
    """probabilities [heads, prompt_len + G - 1, positions] (the rows of the prompt and of the
    generated tokens but the last) -> the G generated tokens' times in seconds from the
    window's start. `frames`: the window's 10 ms mel frames that hold audio."""
    heads, rows, _ = probabilities.shape
    generated = rows - prompt_len + 1
    if generated < 1:
        raise ValueError(f"{rows} attention rows for a prompt of {prompt_len} tokens")
    weights = probabilities[:, prompt_len:, : frames // 2].astype(np.float32)
    if weights.shape[1] == 0:  # one generated token: no row of its own
        return np.zeros(generated)
    mean = weights.mean(axis=1, keepdims=True)
    std = weights.std(axis=1, keepdims=True)
    weights = (weights - mean) / np.where(std > 0, std, 1)
    matrix = median_filter(weights, filter_width).mean(axis=0)
    text, time = dynamic_time_warping(-matrix.astype(np.float64))
    jumps = np.pad(np.diff(text), (1, 0), constant_values=1).astype(bool)
    times = time[jumps] * SECONDS_PER_POSITION
    return np.concatenate([times, times[-1:]])
