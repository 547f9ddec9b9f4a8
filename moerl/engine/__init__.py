"""moerl's embedded inference engine: SGLang's native HTTP API subset on transformers'
model implementations, with continuous batching, routing capture, sampling-mask
capture, weight versions and in-flight weight updates (see DESIGN.md §4)."""
