"""The data-parallel family: ACCO, DDP, ZeRO-1, DPU and weight prediction on one step builder.

Entry points: the methods (:func:`acco_jax.dp.methods.acco`, ``ddp``, ``zero1``, ``dpu``, ``wp``, all
re-exported as ``acco_jax.acco`` etc.) and :func:`acco_jax.dp.step.make_train_step`.

Pure (no collective, no Flax): ``methods`` (optax transforms plus a communication plan), ``flat``
(the shard-major flat layout), ``microbatch`` (the per-device gradient loops), ``quantize`` (the
int8/int4 block format), ``hetero`` (per-worker microbatch budgets) and ``reshard`` (elastic
restore, on the host). Own every collective over the ``data`` axis: ``step`` (state, programs,
API), ``stage`` (one stage's per-device blocks), ``quantized_comm`` and ``probe``. For the run
shell: ``family`` (the registry entry), ``updates`` (stages per update) and ``build`` (a config's run).
"""

# What the other families may import of this one: the LoCo workers run this step and its method
# transforms (their ``loco.inner``) on the layout ``layouts`` chooses, the pipeline's lanes run
# ACCO's transform and its all-gather, and every family checks comm.layout with ``layouts``
# (tests/import_graph_test.py holds every family to its neighbours' lists).
SHARED = ("build", "layouts", "methods", "owner", "quantized_comm", "step")
