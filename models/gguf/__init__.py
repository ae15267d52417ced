"""GGUF files (llama.cpp's format) as checkpoints: the reader, the config and weights they hold
as transformers reads them, and the loading of their tensors into our modules."""
