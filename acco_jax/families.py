"""Every family of the package, registered with the run shell (:mod:`acco_jax.run.registry`).

Imported by the package's ``__init__``, so ``config.method`` resolves wherever ``acco_jax`` is
imported. A new family is a folder with a ``family.py`` (its :class:`acco_jax.family_api.Family`)
and its line here; the order is the order the unknown-method error lists the methods in.
"""

from acco_jax.dp.family import FAMILY as DP
from acco_jax.ensemble.family import FAMILY as ENSEMBLE
from acco_jax.loco.family import FAMILY as LOCO
from acco_jax.pipeline.family import FAMILY as PIPELINE
from acco_jax.run import registry

FAMILIES = tuple(registry.register(family) for family in (DP, LOCO, PIPELINE, ENSEMBLE))
