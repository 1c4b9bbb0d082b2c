"""The low-communication family: DiLoCo, Streaming DiLoCo, NoLoCo, SparseLoCo and DeMo.

A method is one pure file (``diloco``, ``streaming``, ``noloco``, ``sparseloco``, ``demo``) that
fills the slots of one outer step (``base``), with ``compress/`` for its codecs; none of them holds a
collective. The runtime runs them over a ``('replica', 'data')`` mesh: ``step`` (workers, state,
schedule, API: :class:`acco_jax.loco.step.LocoStep`), ``programs`` (the outer-step programs),
``accounting`` (the bytes of a sync) and ``replica``, which owns every collective between workers;
``build`` makes a config's run and ``family`` registers it with the run shell.
Entry points: the method factories re-exported here (``acco_jax.loco.diloco`` and the rest).
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

SHARED = ()  # no other family imports this one (tests/import_graph_test.py)
