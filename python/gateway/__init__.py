"""gateway: an OpenAI-compatible model-serving gateway scheduled by a Rust core."""

__version__ = "0.1.0"
