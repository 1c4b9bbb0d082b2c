"""A data-parallel step's state across device counts and run kinds: what
:class:`acco_jax.dp.step.TrainStep` gives the checkpoint restore (``reshard``, ``saved_like``) and
``ckpt.init_from`` (``export_state``, ``import_state``).

The moves themselves are in :mod:`acco_jax.dp.reshard` (the elementwise layout: flat chunks cut
anew), :mod:`acco_jax.dp.reshard_owner` (the owner layout: owners reassigned) and
:mod:`acco_jax.dp.carry` (to and from the model's structure).
"""

from __future__ import annotations

from typing import Any

from acco_jax.dp import carry, reshard_owner
from acco_jax.dp.reshard import reshard_state, saved_num_devices

PyTree = Any


class Elastic:
  """Mixed into :class:`acco_jax.dp.step.TrainStep` (which sets ``state_type``, ``owner``,
  ``layout``, ``tx``, ``source_tx``, ``plan`` and ``comm_dtype``)."""

  def reshard(self, saved):
    """A state saved on another device count (host numpy leaves) -> numpy leaves for this step.

    Pass it as ``reshard=`` to :meth:`acco_jax.run.checkpoint.Checkpointer.restore`; weights and
    optimizer state move bit for bit, the gradient buffers keep their sums over devices (see
    :mod:`acco_jax.dp.reshard`).
    """
    if self.owner:  # owners reassigned (acco_jax.dp.reshard_owner)
      old_tx = self.source_tx(saved_num_devices(saved))
      return reshard_owner.reshard_owner_state(saved, old_tx, self.layout, self.tx, self.comm_dtype)
    return reshard_state(saved, self.layout, self.tx)

  def saved_like(self, shapes: dict):
    """The structure of a checkpoint whose leaf paths differ from this state's (``shapes``: path ->
    saved shape): with the owner layout, a state saved on another device count has other slots.
    ``None`` for the other layouts (their paths never change)."""
    n = next((s[0] for p, s in shapes.items() if p.startswith(".params") and s), None)
    if not self.owner or n is None:
      return None
    old = reshard_owner.source_layout(self.layout, int(n))
    tx = self.source_tx(int(n))
    return self.state_type(
      **reshard_owner.saved_structure(old, tx, self.plan.delayed, self.comm_dtype)
    )

  def saved_num_devices(self, saved) -> int:
    """The device count ``saved`` (host numpy leaves) was written on."""
    return saved_num_devices(saved)

  def export_state(self, saved):
    """A saved state (host numpy, any device count) -> :class:`acco_jax.run.portable.Portable`:
    θ and the inner state in the model's structure (:mod:`acco_jax.dp.carry`)."""
    return carry.export_state(self, saved)

  def export_params(self, saved) -> PyTree:
    """The committed parameters θ of a saved state (host numpy, any device count), float32 in
    the model's structure (ACCO's and WP's committed copy, not an estimate or prediction)."""
    return carry.export_state(self, saved).params

  def import_state(self, portable, stage: int, microbatch: PyTree | None = None):
    """The state of a run that starts from ``portable`` at ``stage``, placed; a delayed method
    primes its buffer with ``microbatch`` as :meth:`init` does (:mod:`acco_jax.dp.carry`)."""
    return carry.import_state(self, portable, stage, microbatch)
