"""Llama 3.2 Vision (Mllama): images attended through cross-attention layers."""
