"""bench/loco/loco_compare.py's configs: every method's run, in the full setting and in ``--smoke``, is a
config the trainer accepts (the smoke's H once made Streaming DiLoCo's tau = 1 invalid)."""

import pytest

from acco_jax.loco import build
from bench.loco import loco_compare  # noqa: E402

LABELS = [*loco_compare.METHODS, "demo@2e-3", "sparseloco@loco.sync_every=15,loco.bits=32"]


@pytest.mark.parametrize("smoke", [False, True], ids=["full", "smoke"])
@pytest.mark.parametrize("label", LABELS)
def test_every_run_is_a_valid_config(label, smoke):
  name = "smoke" if smoke else "d8"
  config = loco_compare.make_config(label, 0, name)
  s = loco_compare.setting(name)
  assert config.model.D == s["D"] and config.train.num_updates == s["num_updates"]
  base = label.partition("@")[0]
  if base in loco_compare.LOCO:
    method = build.loco_method(config)  # raises the trainer's one-line error on a bad loco group
    assert config.loco.workers == s["workers"]
    if base != "demo":  # a sync within the run
      assert config.loco.sync_every <= config.train.num_updates, method
  if label == "demo@2e-3":
    assert config.opt.lr == 2e-3
  if label.startswith("sparseloco@") and not smoke:
    assert (config.loco.sync_every, config.loco.bits, config.loco.topk) == (15, 32, 64)


@pytest.mark.parametrize(
  "label", ["sparsloco", "diloco@loco.sync_every", "diloco@sync_every=15", "diloco@2e-3x"]
)
def test_a_bad_label_is_one_line_naming_it(label):
  with pytest.raises(SystemExit, match="loco_compare: .*" + label.split("@")[-1][:6]):
    loco_compare.parse_label(label)


@pytest.mark.parametrize(
  "label,message",
  [
    ("diloco@loco.sync_evry=15", "sets loco.sync_evry, which"),
    ("diloco@loco.sync_every=1.5", "takes int"),
    ("diloco@ckpt.async_save=maybe", "takes bool"),
  ],
)
def test_a_sweep_the_config_cannot_take_is_refused(label, message):
  with pytest.raises(SystemExit, match=message):
    loco_compare.make_config(label, 0)


def test_a_sweep_value_is_read_as_its_fields_type():
  c = loco_compare.make_config("diloco@loco.outer_lr=1,loco.quantize=fp4,loco.sync_every=15", 0)
  assert (c.loco.outer_lr, c.loco.quantize, c.loco.sync_every) == (1.0, "fp4", 15)
  assert isinstance(c.loco.outer_lr, float) and isinstance(c.loco.sync_every, int)
  assert loco_compare.make_config("diloco@ckpt.async_save=true", 0).ckpt.async_save is True


def test_main_refuses_a_bad_label_before_any_run(tmp_path):
  with pytest.raises(SystemExit, match="sync_evry"):
    loco_compare.main(["--out", str(tmp_path), "--methods", "diloco@loco.sync_evry=15"])
  assert not (tmp_path / "runs").exists()
