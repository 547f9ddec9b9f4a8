"""LoRA adapters in the engine: loaded and applied per request (``adapters``), per-expert
adapters of MoE layers (``experts``) and SGLang's adapter routes (``routes``)."""
