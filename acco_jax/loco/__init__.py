"""The low-communication family: methods as choices of the slots of one outer step (pure).

:mod:`acco_jax.loco_step` runs them over a ``('replica', 'data')`` mesh.
"""

from acco_jax.loco.base import LocoMethod as LocoMethod
from acco_jax.loco.base import OuterState as OuterState
from acco_jax.loco.base import Pairing as Pairing
from acco_jax.loco.base import Sparsify as Sparsify
from acco_jax.loco.base import default_outer as default_outer
from acco_jax.loco.compress import Compressor as Compressor
from acco_jax.loco.compress import get_compressor as get_compressor
from acco_jax.loco.demo import demo as demo
from acco_jax.loco.demo import keep_gradient as keep_gradient
from acco_jax.loco.diloco import diloco as diloco
from acco_jax.loco.noloco import noloco as noloco
from acco_jax.loco.sparseloco import sparseloco as sparseloco
from acco_jax.loco.streaming import streaming_diloco as streaming_diloco

METHODS = ("diloco", "streaming_diloco", "noloco", "sparseloco", "demo")
