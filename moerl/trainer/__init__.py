"""The megatron-core trainer: model wrapping, optimizer, schedules and train steps."""
