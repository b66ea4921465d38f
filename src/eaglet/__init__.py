"""eaglet: train EAGLE-3 draft heads and ship them to vLLM and SGLang."""

__version__ = "0.1.0"
