"""A video stream's display matrix (rotation / mirroring metadata) as array operations that
turn a decoded [H, W, C] frame upright."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import av
import numpy as np
from av.sidedata.sidedata import Type as SideDataType


@dataclass(frozen=True)
class Orientation:
    """The display matrix as array operations on an [H, W, C] frame, applied in this order."""

    transpose: bool = False
    flip_rows: bool = False
    flip_cols: bool = False

    def apply(self, frame: np.ndarray) -> np.ndarray:
        """A view of `frame` shown as this orientation says."""
        if self.transpose:
            frame = frame.transpose(1, 0, 2)
        if self.flip_rows:
            frame = frame[::-1]
        if self.flip_cols:
            frame = frame[:, ::-1]
        return frame


def display_matrix(frame: av.VideoFrame) -> list[int] | None:
    """The frame's display matrix side data, or None when it has none."""
    side_data = frame.side_data.get(SideDataType.DISPLAYMATRIX)
    if side_data is None:
        return None
    # Nine native-endian int32 values, row-major; the 2x2 part is 16.16 fixed point.
    return np.frombuffer(bytes(side_data), dtype=np.int32).tolist()


def orientation_of(matrix: Sequence[int] | None) -> Orientation:
    """Snap a display matrix to the nearest of the eight right-angle orientations.

    FFmpeg maps a source pixel (x, y), y pointing down, to (a*x + c*y, b*x + d*y) with
    a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4].
    """
    if matrix is None:
        return Orientation()
    a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4]
    if abs(a) + abs(d) >= abs(b) + abs(c):
        return Orientation(flip_rows=d < 0, flip_cols=a < 0)
    # Output columns come from input rows (sign c), output rows from input columns (sign b).
    return Orientation(transpose=True, flip_rows=b < 0, flip_cols=c < 0)


def upright(frame: np.ndarray, matrix: Sequence[int] | None) -> np.ndarray:
    """A view of an [H, W, C] frame as the display matrix says to show it."""
    return orientation_of(matrix).apply(frame)
