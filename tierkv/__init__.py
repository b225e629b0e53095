"""tierkv: a multi-tier KV-cache offloading service for LLM inference."""

__version__ = "0.1.0"
