"""moerl's embedded inference engine: SGLang's native HTTP API subset on transformers'
model implementations, with continuous batching, routing capture, sampling-mask
capture, weight versions and in-flight weight updates (see docs/architecture.md, "The
engine protocol")."""

API_KEY_ENV = "MOERL_API_KEY"
"""The environment variable engines and clients read the API key from when none is given
(SGLang has none for its --api-key); the launcher sets a fresh key per run."""
