"""The OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``)
over the native ``/generate`` machinery: requests, responses, streams, chat templates, tool
calls and tool choice."""
