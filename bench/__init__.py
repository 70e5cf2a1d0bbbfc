"""Benchmarks: funcshard against PyTorch FSDP2, FSDP1, DDP and the floor on the same GPTs, in one run.

``python -m bench --help`` for the options; ``nox -s bench`` runs the default
configuration (34m, W=2, glibc's default allocator and the mmap threshold, both)
and writes ``bench/results/``, whose ``results.md`` states the command, machine,
date and allocators. ``floor`` is one rank's work alone (its batch, one process,
no communication, plain PyTorch): every mode's step is reported as a multiple of
it. ``--size deep --world-size 1`` gives funcshard's and FSDP2's per-unit
overhead over plain PyTorch. ``--tiny`` is a smoke run.
"""
