"""What the media items of one request have cost so far: encoded bytes read, and decoded bytes
reserved from headers before the decoders allocate them. Shared by the request's worker
threads."""

from __future__ import annotations

import threading

from engine.media.limits import MediaError, MediaLimits


class RequestBudget:
    """The request-wide byte caps of ``MediaLimits``, charged by every item of one request.

    ``max_bytes`` bounds the encoded bytes read (files, downloads, base64 payloads);
    ``max_decoded_bytes`` (None: no bound) the decoded output (RGB pixels, float32 samples),
    which items reserve from their headers before decoding, so that a request is refused
    before it allocates more than the cap.
    """

    def __init__(self, max_bytes: int, max_decoded_bytes: int | None = None) -> None:
        self._max_bytes = max_bytes
        self._max_decoded = max_decoded_bytes
        self._used = 0
        self._decoded = 0
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_limits(cls, limits: MediaLimits) -> RequestBudget:
        """A fresh budget with the request-wide caps of ``limits``."""
        return cls(limits.max_request_bytes, limits.max_request_decoded_bytes)

    def charge(self, nbytes: int, item: str) -> None:
        """Count ``nbytes`` more encoded bytes; raise MediaError once the request total passes
        the limit."""
        with self._lock:
            self._used += nbytes
            over = self._used > self._max_bytes
        if over:
            raise MediaError(
                f"{item}: the request's media exceeds the limit of {self._max_bytes} bytes "
                "(MediaLimits.max_request_bytes)"
            )

    def reserve_decoded(self, nbytes: int, item: str) -> None:
        """Reserve up to ``nbytes`` of decoded output for ``item`` (only the growth over what
        it reserved before counts); raise MediaError, reserving nothing, when the request's
        decoded total would pass the limit."""
        with self._lock:
            growth = nbytes - self._reserved.get(item, 0)
            if growth <= 0:
                return
            total = self._decoded + growth
            if self._max_decoded is None or total <= self._max_decoded:
                self._decoded = total
                self._reserved[item] = nbytes
                return
        raise MediaError(
            f"{item}: decoding it would bring the request's decoded media to {total} bytes, "
            f"more than the limit of {self._max_decoded} bytes "
            "(MediaLimits.max_request_decoded_bytes)"
        )
