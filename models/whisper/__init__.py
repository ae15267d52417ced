"""Whisper (speech to text): model.py, processor.py, prompt.py (the decoder prompt), ctranslate2.py
(faster-whisper's CTranslate2 folders)."""
