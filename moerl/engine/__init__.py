"""moerl's embedded inference engine: SGLang's native HTTP API subset on transformers'
model implementations, with continuous batching, routing capture, sampling-mask
capture, weight versions and in-flight weight updates (see docs/architecture.md, "The
engine protocol").

Its parts, each layer importing only those below it (the import-linter contract in
pyproject.toml):

- ``__main__`` (``python -m moerl.engine``), ``inprocess`` (an engine inside this
  process) and ``process`` (one in a child process);
- ``launch`` (the model, scheduler and app built from the flags) and ``cli`` (the flags);
- ``app``: the FastAPI app, SGLang's native control routes, and the route groups below;
- ``openai`` (the OpenAI-compatible API) and ``lora`` (adapters and their routes);
- ``weights``: pushed weights (the routes, and the bucket, group and tensor-handle formats
  the trainer's side shares);
- ``native``: SGLang's ``/generate``, parsed, answered and streamed;
- ``core``: the scheduler thread, model runner, KV pool, prefix cache, sampling, grammar;
- ``validate``: the typed checks of every request body.
"""

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 30000
"""``--host`` and ``--port`` when not given (SGLang's port; here, where the flags are read
before anything heavy is imported: moerl/engine/__main__.py binds the port first)."""

API_KEY_ENV = "MOERL_API_KEY"
"""The environment variable engines and clients read the API key from when none is given
(SGLang has none for its --api-key); the launcher sets a fresh key per run."""
