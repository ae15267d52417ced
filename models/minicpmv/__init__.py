"""MiniCPM-V 4.6: slices of large images, its window-merging tower, Qwen3.5 decoder."""
