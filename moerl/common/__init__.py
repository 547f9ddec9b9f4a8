"""The bottom layer: pieces every other package may use and that import nothing from moerl.

    registry.py    name → function registries (`Registry`) and name → value tables (`Catalog`)
    deferred_compile.py  megatron-core's `@jit_fuser` compiles on first call, not at import
    module_walk.py a model's `modules()` walked once and kept while its tree is unchanged
    checks.py      start-up checks with user words: `one_of` for string options, range helpers
    trajectory.py  `Trajectory`, one sampled completion, as the engine returns it and the
                   buffer, tasks and trainer read it

Importing this package imports nothing; import the modules themselves.
"""
