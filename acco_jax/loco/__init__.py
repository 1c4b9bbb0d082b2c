"""The low-communication family: methods as choices of the slots of one outer step (pure).

:mod:`acco_jax.loco_step` runs them over a ``('replica', 'data')`` mesh.
"""

from acco_jax.loco.base import LocoMethod as LocoMethod
from acco_jax.loco.base import OuterState as OuterState
from acco_jax.loco.base import default_outer as default_outer
from acco_jax.loco.compress import Compressor as Compressor
from acco_jax.loco.compress import get_compressor as get_compressor
from acco_jax.loco.diloco import diloco as diloco
from acco_jax.loco.streaming import streaming_diloco as streaming_diloco

METHODS = ("diloco", "streaming_diloco")
