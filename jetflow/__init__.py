"""jetflow: lossless speculative decoding with causal parallel tree drafting."""

__version__ = "0.1.0"
