"""AngelSpec: train speculative-decoding drafters for a frozen target LLM and run them losslessly."""

__version__ = "0.1.0"
