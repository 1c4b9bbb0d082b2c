"""opt.name=muon through the config: the layout ``comm.layout=auto`` picks, the one-line refusals,
and a tiny run of train.py's loop under ACCO (issue 39)."""

import math

import jax
import pytest

from acco_jax import errors, model, optim
from acco_jax.dp import build as dp_build
from acco_jax.dp import layouts
from acco_jax.dp.owner import OwnerLayout
from acco_jax.run import build, trainer
from configs import (
  gpt2_acco,
  gpt2_diloco,
  gpt2_dpu,
  gpt2_streaming_diloco,
  gpt2_zero1,
)
from tests.train_test import rows, tiny


def shapes():
  cfg = model.get_config("tiny", V=257, L=32)
  return jax.eval_shape(lambda: model.init_params(cfg, 0))


@pytest.mark.parametrize("module", [gpt2_acco, gpt2_zero1])
def test_auto_layout_is_owner_for_muon_and_elementwise_for_adamw(module):
  p = shapes()
  muon = tiny(module, **{"opt.name": "muon"})
  assert layouts.for_config(muon, 8) == "owner"
  assert layouts.for_config(tiny(module), 8) == "elementwise"
  tx, owned = dp_build.method(muon, 8, p)
  assert tx.plan.layout == "owner" and owned == model.muon_mask(p)
  # Muon owns the blocks' kernels; embeddings, head, biases and LayerNorms are elementwise AdamW
  layout = OwnerLayout(p, 8, owned)
  assert {layout.shapes[i] for i in layout.elem} >= {(257, 64), (32, 64), (64,)}
  assert all(len(s) == 2 for s in layout.groups)
  assert optim.hyperparams(jax.eval_shape(lambda q: jax.vmap(tx.init)(layout.to_shards(q)), p))[
    "muon_learning_rate"
  ].shape == (8,)


def test_muon_is_refused_where_it_cannot_run():
  p = shapes()
  config = tiny(gpt2_acco, **{"opt.name": "muon", "comm.layout": "elementwise"})
  with pytest.raises(errors.UserValueError, match="set comm.layout=owner \\(or auto\\)"):
    layouts.for_config(config, 8)
  config = tiny(gpt2_dpu, **{"opt.name": "muon"})
  with pytest.raises(errors.UserValueError, match="method=dpu shards its optimizer elementwise"):
    layouts.for_config(config, 8)
  config = tiny(gpt2_zero1, **{"opt.name": "muon", "comm.quantize": "int8"})
  with pytest.raises(errors.UserValueError, match="does not run with the owner layout"):
    layouts.for_config(config, 8)
  config = tiny(gpt2_diloco, **{"opt.name": "muon", "loco.inner": "ddp"})
  with pytest.raises(errors.UserValueError, match="set loco.inner=zero1"):
    build.build(config)
  config = tiny(gpt2_streaming_diloco, **{"opt.name": "muon", "loco.fragments": 2})
  with pytest.raises(errors.UserValueError, match="loco.fragments=2 does not run with the owner"):
    build.build(config)
  config = tiny(gpt2_zero1, **{"opt.name": "muon", "opt.ns_steps": 0})
  with pytest.raises(errors.UserValueError, match="opt.ns_steps=0 >= 1"):
    optim.from_config(config, p)


def test_muloco_layout_owns_each_workers_matrices():
  """gpt2_diloco with opt.name=muon: the inner zero1 step of each worker takes the owner layout
  over the worker's devices, owning exactly Muon's matrices."""
  from acco_jax.loco import build as loco_build

  p = shapes()
  config = tiny(gpt2_diloco, **{"opt.name": "muon", "loco.workers": 4})
  layout, owned, view = loco_build._inner_layout(config, 2, p)
  assert layout == "owner" and owned == model.muon_mask(p)
  seen = view(owned)  # the optimizer's structure: Muon's label on every owned slot, AdamW's else
  assert seen["owned"] and all(seen["owned"]) and not any(seen["elementwise"])
  assert loco_build._inner_layout(tiny(gpt2_diloco), 2, p)[0] == "elementwise"


@pytest.mark.slow  # ~30 s on 2 cores: the compiles of a full run
def test_acco_muon_trains_through_the_trainer(tmp_path):
  """train.py's loop with opt.name=muon under acco: the owner layout, finite and falling loss."""
  config = tiny(gpt2_acco, **{"opt.name": "muon", "train.num_updates": 4, "ckpt.every": 0})
  config.train.eval_every, config.train.sample_tokens = 0, 0
  summary = trainer.train_and_evaluate(config, str(tmp_path))
  losses = [r["loss"] for r in rows(tmp_path) if "loss" in r]
  assert summary["updates"] == 4 and all(map(math.isfinite, losses))
  assert losses[-1] < losses[0]
  last_row = [r for r in rows(tmp_path) if "loss" in r][-1]
  assert {"lr", "grad_norm"} <= set(last_row)
