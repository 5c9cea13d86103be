"""Hugging Face transformers' MoE models on moe-kernels (the ``hf`` extra, transformers 5).

Two ways in (docs/hf_interop.md):

* the ``"moe_kernels"`` experts backend, registered in transformers' ``ExpertsInterface`` when
  this package is imported (importing ``moe_model`` never imports transformers)::

      import moe_model.hf  # noqa: F401
      model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moe_kernels")
      model.set_experts_implementation("moe_kernels")  # or switch a loaded model

  HF's router stays; every family's experts run on our kernels (``backend``);
* block replacement: ``replace_moe_blocks(model)`` swaps each sparse MoE block for a
  ``MoEBlock`` running ``MoELayer`` (our routing too) on HF's tensors, zero-copy, HF's names in
  the state dict, router logits and the aux loss kept; ``restore_moe_blocks(model)`` undoes it
  (``blocks``).
"""

from __future__ import annotations

try:
    import transformers.integrations.moe  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised where transformers is absent
    raise ImportError(
        "moe_model.hf needs Hugging Face transformers >= 5 (pip install 'moe-model[hf]')"
    ) from e

from moe_model.hf.backend import BACKEND, experts_forward, fused, register
from moe_model.hf.blocks import FAMILIES, MoEBlock, replace_moe_blocks, restore_moe_blocks

__all__ = [
    "BACKEND",
    "FAMILIES",
    "MoEBlock",
    "experts_forward",
    "fused",
    "register",
    "replace_moe_blocks",
    "restore_moe_blocks",
]

register()
