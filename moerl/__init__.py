"""moerl: asynchronous RL for Mixture-of-Experts LLMs on megatron-core and SGLang."""

__version__ = "0.1.0"
