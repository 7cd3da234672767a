"""The in-process simulator: the same ``services.core`` decisions on a virtual clock."""

from loadgen.sim.config import SimConfig
from loadgen.sim.run import SimResult, simulate

__all__ = ["SimConfig", "SimResult", "simulate"]
