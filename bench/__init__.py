"""Benchmarks of rollstream against physical and reference anchors; see bench/README.md.

Run each script from the repository root as a module, e.g. ``python -m bench.codec``.
Nothing here is imported by the project's packages.
"""
