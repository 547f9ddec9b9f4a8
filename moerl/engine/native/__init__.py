"""SGLang's native ``/generate``, parsed into scheduler requests and answered or streamed
as SGLang's server does (``generate``), and ``/server_info`` (``info``)."""
