"""The engine's core, below any HTTP: the scheduler thread (continuous batching, chunked
prefill, weight swaps between steps), the model runner over transformers' models, the KV
pool and prefix cache, sampling, grammars, end-of-sequence ids and decode CUDA graphs."""
