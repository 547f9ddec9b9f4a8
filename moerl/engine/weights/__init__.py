"""Pushed weights: the engine's ``/update_weights_from_distributed`` and
``/update_weights_from_tensor`` routes (``routes``), and the formats the trainer's side
shares with them: flattened buckets (``bucket``), the weight-update process group
(``group``) and tensor handles (``tensor_payload``)."""
