"""Benchmarks: funcshard against PyTorch FSDP2, FSDP1 and DDP on the same GPT, in one run.

``python -m bench --help`` for the options; ``nox -s bench`` runs the default
configuration and writes ``bench/results/``.
"""
