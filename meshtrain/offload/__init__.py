"""Host offload: the optimizer state kept in host memory between steps.

- `Offload`: the run setting (``RunSpec(offload=Offload(optimizer=True))``,
  ``--offload optimizer``).
- `with_offload`: a state and its shardings with the optimizer state moved to host memory.
- `to_device`: the host-resident leaves of a tree fetched to the device (inside the step).
- `host_bytes`, `transfer_bytes`: what lives in host memory per device, and what a step moves.

Activations go to host memory through the remat policies (`meshtrain.models.remat`:
``offload-dots``, ``offload:NAME,...``).
"""

from meshtrain.offload.config import Offload, memory_kinds
from meshtrain.offload.placement import host_bytes, to_device, transfer_bytes, with_offload

__all__ = ["Offload", "host_bytes", "memory_kinds", "to_device", "transfer_bytes", "with_offload"]
