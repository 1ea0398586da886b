"""cpuserve's HTTP service: an OpenAI-compatible API over the engine (``python -m service --help``)."""

__version__ = "0.1.0"
