"""Multimodal rotary position ids (M-RoPE) of the Qwen-VL and Qwen-Omni families: a (temporal,
height, width) triple per token, computed on the host once per request (by the processors), and
the positions of any later token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def mrope_positions(
    input_ids: Sequence[int],
    *,
    image_grid_thw: Sequence[Sequence[int]],
    video_grid_thw: Sequence[Sequence[int]],
    second_per_grid_ts: Sequence[float] | None,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    tokens_per_second: float | None,
) -> tuple[torch.Tensor, int]:
    """Positions int64 [3, L] of a prompt and its decode delta (max position + 1 - L).

    Every image/video span must directly follow a ``vision_start_token_id`` and hold
    t*h*w / spatial_merge_size**2 placeholder tokens for its grid (in patches, as the
    preprocessor returns it). Text advances all three rows by one per token. A span gets its
    (t, h, w) merged-grid coordinates plus the running text position; text after the span
    continues from the span's largest position + 1, the rule the checkpoints were trained with
    (Qwen's reference code, transformers 4.x, vLLM). transformers 5.23's ``get_rope_index``
    instead moves on by max(h, w) merged patches: the same for images, but for a video whose
    time extent exceeds its spatial extent it makes the following text reuse positions inside
    the video (tests/test_mrope.py pins both facts).

    Qwen2-VL (``tokens_per_second`` None) uses the temporal patch index as t. Qwen2.5-VL scales
    a video's index by ``second_per_grid_t * tokens_per_second`` in float32 and truncates,
    matching HF given the processor's float32 ``second_per_grid_ts`` (1.0 each when None).
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)  # [L]
    length = len(ids)
    seconds = [1.0] * len(video_grid_thw) if second_per_grid_ts is None else second_per_grid_ts
    if len(seconds) != len(video_grid_thw):
        raise ValueError(f"{len(seconds)} second_per_grid_ts for {len(video_grid_thw)} videos")
    pending = {
        image_token_id: iter([(tuple(g), None) for g in image_grid_thw]),
        video_token_id: iter(
            (tuple(g), None if tokens_per_second is None else _time_scale(s, tokens_per_second))
            for g, s in zip(video_grid_thw, seconds, strict=True)
        ),
    }
    is_vision = (ids == image_token_id) | (ids == video_token_id)  # [L]
    starts = (is_vision[1:] & (ids[:-1] == vision_start_token_id)).nonzero().flatten() + 1

    pieces, cursor, next_pos, covered = [], 0, 0, 0
    for start in starts.tolist():
        token = int(ids[start])
        grid, time_scale = next(pending[token], (None, None))
        if grid is None:
            raise ValueError(f"more spans of token {token} in the prompt than grids given")
        block = _grid_positions(grid, spatial_merge_size, time_scale)  # [3, n]
        n = block.shape[1]
        if not bool((ids[start : start + n] == token).all()) or start + n > length:
            raise ValueError(f"span at {start} should hold {n} tokens {token} for grid {grid}")
        pieces.append(_text_positions(next_pos, start - cursor))
        next_pos += start - cursor
        pieces.append(block + next_pos)
        next_pos += int(block.max()) + 1
        cursor, covered = start + n, covered + n
    pieces.append(_text_positions(next_pos, length - cursor))

    unused = [t for t, grids in pending.items() if next(grids, None) is not None]
    if unused or covered != int(is_vision.sum()):
        raise ValueError(
            f"prompt placeholders do not match the grids: {covered} of {int(is_vision.sum())} "
            f"vision tokens sit in spans after a vision start; grids left for tokens {unused}"
        )
    positions = torch.cat(pieces, dim=1)  # [3, L]
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def _text_positions(first: int, n: int) -> torch.Tensor:
    """[3, n]: first .. first+n-1 on all three rows."""
    return torch.arange(first, first + n).repeat(3, 1)


def _time_scale(second_per_grid_t: float, tokens_per_second: float) -> torch.Tensor:
    """Temporal position step of a Qwen2.5-VL video, in float32 like HF's processor output."""
    return torch.tensor(second_per_grid_t, dtype=torch.float32) * tokens_per_second


def _grid_positions(
    grid: tuple[int, int, int], merge: int, time_scale: torch.Tensor | None
) -> torch.Tensor:
    """[3, t*h*w] merged-grid coordinates of one span, row-major over (t, h, w)."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    t_pos = torch.arange(t)  # [t]
    if time_scale is not None:
        t_pos = (t_pos * time_scale).long()  # [t], truncated toward zero
    return torch.stack(
        [
            t_pos.view(t, 1, 1).expand(t, h, w),
            torch.arange(h).view(1, h, 1).expand(t, h, w),
            torch.arange(w).view(1, 1, w).expand(t, h, w),
        ]
    ).reshape(3, -1)  # [3, t*h*w]


def decode_positions(delta: int, start: int, n: int) -> torch.Tensor:
    """Positions int64 [3, n] of sequence indices start .. start+n-1 past the prompt: i + delta."""
    return _text_positions(start + delta, n)


def window_positions(
    prompt_positions: torch.Tensor, delta: int, start: int, end: int
) -> torch.Tensor:
    """Positions int64 [3, end-start] of sequence indices [start, end) of a request.

    Indices inside the prompt are sliced from ``prompt_positions`` [3, P]; later ones (generated
    tokens) follow ``decode_positions``. Serves chunked prefill and decode alike.
    """
    if not 0 <= start <= end:
        raise ValueError(f"bad window [{start}, {end})")
    split = min(max(start, prompt_positions.shape[1]), end)
    return torch.cat(
        [prompt_positions[:, start:split], decode_positions(delta, split, end - split)], dim=1
    )


@dataclass(frozen=True)
class MRopePositions:
    """A request's mRoPE positions: its prompt's [3, P] and the decode delta."""

    prompt: torch.Tensor
    delta: int

    def window(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of sequence indices [start, end)."""
        return window_positions(self.prompt, self.delta, start, end)
