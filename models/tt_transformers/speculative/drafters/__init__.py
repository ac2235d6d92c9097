# SPDX-License-Identifier: Apache-2.0
"""The drafters, one per file behind one interface (base.py: Drafter, Draft, Verified): model.py (a draft model),
copied.py (copied drafts: SuffixDrafter), hybrid.py (copied or another, per step), eagle3.py (an EAGLE-3 head beside
the target) and eagle3_device.py (a head on a TT device), the two heads sharing eagle3_base.py. `make_drafter`
(factory.py) assembles them from a SpeculativeConfig."""
from .base import Draft, Drafter, FallbackDrafter, Verified
from .copied import SuffixDrafter
from .eagle3 import HeadDrafter
from .eagle3_device import TracedHeadDrafter
from .hybrid import HybridDrafter
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "FallbackDrafter", "HeadDrafter", "HybridDrafter", "ModelDrafter", "SuffixDrafter",
           "TracedHeadDrafter", "Verified"]
