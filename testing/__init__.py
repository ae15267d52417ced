"""Test and demo support that ships with the repository but not inside the runtime packages:
builders of tiny random-weight checkpoints in real Hugging Face format."""
