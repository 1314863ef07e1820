"""detaudit: audit whether LLM inference is reproducible."""

__version__ = "0.1.0"
