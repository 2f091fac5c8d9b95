"""Communication: what the compiled step sends (`inspect`), parsed from its HLO and compared
with what its layout needs."""

from meshtrain.comm.compile import compile_step
from meshtrain.comm.hlo import Collective, collectives
from meshtrain.comm.inspector import Inspection, inspect, inspect_compiled

__all__ = [
    "Collective",
    "Inspection",
    "collectives",
    "compile_step",
    "inspect",
    "inspect_compiled",
]
