"""moerl: asynchronous RL for Mixture-of-Experts LLMs on megatron-core and SGLang."""

from moerl._version import __version__

__all__ = ["__version__"]
