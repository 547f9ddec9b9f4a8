"""Weight and adapter sync between the trainer and the inference engines."""
