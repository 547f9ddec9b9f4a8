"""Triton kernels with torch reference twins, installed as `moerl.kernels`.

Each kernel ships beside a plain-torch twin that defines its semantics and runs on
CPU; tests compare the two on a GPU. Filled by a later issue.
"""
