"""Efficiency profiles: the fraction of peak FLOP/s a model's compute reaches, named and calibrated.

[Note: efficiency profiles]
A step's compute time is its FLOPs over ``efficiency * peak_flops`` (``step_time.py``).
The efficiency depends on the software more than on the device: fused kernels,
FlashAttention and ``torch.compile`` against eager attention and unfused layers. A
profile names one value and the published runs it reproduces (within 25 %, held by
``tests/test_cli.py`` to the table in ``docs/planner.md``):

- ``tuned`` (0.5), the **default**: fused or compiled kernels and FlashAttention, as
  torchtitan runs Llama-3.1-8B on 8 H100s (5,762 tokens/s per GPU, 33-39 % MFU) and
  the PyTorch FSDP paper runs GPT-175B on 128 A100s (173 TFLOP/s per GPU);
- ``eager`` (0.24): Hugging Face ``transformers`` models with eager attention under
  FSDP, as BLOOM-7B (~1,000 tokens/s per GPU) and LLaMA-13B (~800) train on 8 A100s.

A calibrated machine (``funcshard calibrate``) measures its own efficiency; a profile or a
number given explicitly (``--efficiency``) replaces it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from funcshard._src.plan.hardware import Hardware

PROFILES: Mapping[str, float] = {"tuned": 0.5, "eager": 0.24}
DEFAULT_PROFILE = "tuned"
PROFILE_MEANINGS: Mapping[str, str] = {
    "tuned": "fused/compiled kernels and FlashAttention (torchtitan, the FSDP paper)",
    "eager": "Hugging Face models with eager attention under FSDP",
}


def parse_efficiency(text: str, /) -> tuple[float, str]:
    """``"eager"`` or ``"0.4"``: the efficiency and how a report names it.

    Raises:
        ValueError: neither a profile nor a number in (0, 1], naming the profiles.

    Example:
        >>> parse_efficiency("eager"), parse_efficiency("0.4")
        ((0.24, "profile 'eager'"), (0.4, 'given'))
    """
    if text in PROFILES:
        return PROFILES[text], f"profile {text!r}"
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(
            f"--efficiency {text!r}: give a profile ({', '.join(f'{k} = {v}' for k, v in PROFILES.items())}; "
            f"default {DEFAULT_PROFILE}) or a fraction of peak FLOP/s in (0, 1]"
        )
    return value, "given"


def with_efficiency(hardware: Hardware, efficiency: float, label: str, /) -> Hardware:
    """``hardware`` with ``efficiency`` in place of its own, its source saying so.

    Example:
        >>> from funcshard._src.plan.hardware import get_hardware
        >>> with_efficiency(get_hardware("a100-80gb"), 0.24, "profile 'eager'").efficiency
        0.24
    """
    source = f"efficiency {efficiency:g} ({label}; see [Note: efficiency profiles] in plan/efficiency.py)"
    if hardware.source:  # what the other figures are: a preset's note or a calibration's
        source = f"{hardware.source.split(';')[0]}; {source}"
    return dataclasses.replace(hardware, efficiency=efficiency, source=source)
