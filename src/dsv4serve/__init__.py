"""dsv4serve: a launcher for DeepSeek-V4-Flash-Vision EXL3 seats under vLLM that proves what it runs."""

__version__ = "0.1.0"
