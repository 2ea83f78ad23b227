"""The flat-tensor all_gather under the name this torch has: torch 2.13 renamed
``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns); same contract."""

from __future__ import annotations

import torch.distributed as dist

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
