"""HDEE budgets: steps per job from a FLOP budget in each mode, parsing, and one-line errors."""

from __future__ import annotations

import pathlib

import pytest

from acco_jax.ensemble import budgets, recipe
from configs import hdee

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = REPO / ".pytest_cache" / "acco_data"

EXPERTS = budgets.parse_experts("hard:L,easy:S")
DOMAINS = budgets.parse_domains("hard:1:a,hard:2:b,easy:1:c,easy:2:d,easy:0:e", ["hard", "easy"])
FPT = {"S": 2.0, "M": 3.0, "L": 5.0}  # FLOPs per token of each size
KW = dict(
  flops_per_token=FPT,
  tokens_per_step=10,
  homogeneous_size="M",
  step_weights={"hard": 3.0, "easy": 1.0},
)


def steps(mode, budget):
  jobs = budgets.expert_jobs(mode, EXPERTS, DOMAINS, budget_flops=budget, **KW)
  return {j.name: (j.size, j.steps, j.init) for j in jobs}, sum(j.flops for j in jobs)


def test_homogeneous_same_size_same_steps():
  # 4 jobs of size M: 4 * 3 * 10 = 120 FLOPs per step of each; 1000 // 120 = 8
  got, spent = steps("homogeneous", 1000.0)
  assert {v[:2] for v in got.values()} == {("M", 8)}
  assert spent == 8 * 120 <= 1000
  assert got["homogeneous/hard-2"][2] == "homogeneous/hard-1"
  assert got["homogeneous/hard-1"][2] == "seed-M"


def test_steps_mode_weights_steps_by_group():
  # sum_j w_j c_j = (3 + 3 + 1 + 1) * 30 = 240; hard: floor(3 * 1000 / 240) = 12, easy: 4
  got, spent = steps("steps", 1000.0)
  assert got["steps/hard-1"][:2] == ("M", 12) and got["steps/hard-2"][:2] == ("M", 12)
  assert got["steps/easy-1"][:2] == ("M", 4) and got["steps/easy-2"][:2] == ("M", 4)
  assert spent == (24 + 8) * 30 <= 1000


def test_sizes_mode_gives_each_expert_its_size():
  # one step of every job: 2 * (5 + 2) * 10 = 140; 1000 // 140 = 7
  got, spent = steps("sizes", 1000.0)
  assert got["sizes/hard-1"][:2] == ("L", 7) and got["sizes/easy-2"][:2] == ("S", 7)
  assert got["sizes/easy-1"][2] == "seed-S"
  assert spent == 7 * 140


def test_dense_job_spends_the_same_budget():
  job = budgets.dense_job("M", 3.0, 10, 1000.0)
  assert job.steps == 33 and job.init == "seed-M"


def test_measured_difficulty_regroups_by_seed_loss():
  losses = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 0.5, "e": 9.0}
  got = {
    d.name: (d.group, d.iteration)
    for d in budgets.measured_groups(DOMAINS, losses, ["hard", "easy"])
  }
  assert got == {
    "c": ("hard", 1),
    "b": ("hard", 2),
    "a": ("easy", 1),
    "d": ("easy", 2),
    "e": ("easy", 0),
  }


@pytest.mark.parametrize(
  "mode,budget,match",
  [
    ("mean", 1000.0, r"hdee.modes: unknown mode 'mean': choose from homogeneous, steps, sizes"),
    ("homogeneous", 100.0, r"hdee.budget_flops=100 buys mode 'homogeneous' less than one step"),
    (
      "sizes",
      45.0,
      r"expert 'hard' of size 'L' needs 50 FLOPs for one step of 10 tokens, more "
      r"than hdee.budget_flops=45",
    ),
  ],
  ids=["unknown-mode", "budget-below-one-step", "expert-larger-than-budget"],
)
def test_bad_budgets_are_one_line_errors(mode, budget, match):
  with pytest.raises(ValueError, match=match) as info:
    budgets.expert_jobs(mode, EXPERTS, DOMAINS, budget_flops=budget, **KW)
  assert "\n" not in str(info.value)


@pytest.mark.parametrize(
  "spec,match",
  [
    ("hard:1:a,easy:1:c,hard:2:b", r"group 'easy' trains on iterations \[1\]; every group needs"),
    ("hard:1:a,mid:1:c", r"domain 'c' is in group 'mid', which has no expert"),
    ("hard:x:a", r"'hard:x:a' is not group:iteration:name"),
    ("hard:1:a,easy:1:a", r"domain names must be unique"),
  ],
  ids=["missing-iteration", "group-without-expert", "not-group-iteration-name", "duplicate-name"],
)
def test_bad_domain_lists(spec, match):
  with pytest.raises(ValueError, match=match):
    budgets.parse_domains(spec, ["hard", "easy"])


def tiny(**overrides):
  c = hdee.get_config("tiny")
  c.data.cache_dir = str(CACHE)
  for key, value in overrides.items():
    group, _, field = key.rpartition(".")
    (c[group] if group else c)[field] = value
  return c


def test_domain_with_no_text(tmp_path):
  (tmp_path / "empty.txt").write_text("\n\n  \n")
  spec = hdee.get_config("tiny").hdee.domains.replace(
    "easy:0:kjv_gospels", f"easy:0:void=text:{tmp_path}/empty.txt"
  )
  with pytest.raises(ValueError, match=r"^hdee domain 'void': text source .* hold no text") as info:
    recipe.make_plan(tiny(**{"hdee.domains": spec}))
  assert "\n" not in str(info.value)


@pytest.mark.parametrize(
  "overrides,match",
  [
    ({"hdee.budget_flops": 2e8}, r"buys mode 'homogeneous' less than one step"),
    ({"hdee.budget_flops": 1.0e8, "hdee.modes": "sizes"}, r"expert 'hard' of size 'L' needs"),
    ({"hdee.modes": "steps,mean"}, r"unknown mode 'mean'"),
    ({"hdee.domains": "hard:1:nope,easy:1:kjv_law"}, r"'nope' is not a built-in domain"),
    ({"data.tokenizer": "bpe:512"}, r"experts would not share a vocabulary"),
    ({"hdee.mixing": "simple_avg,max"}, r"unknown rule 'max'"),
    ({"hdee.experts": "hard:XL,easy:S"}, r"size 'XL' .* not a class of hdee.sizes .* add a class"),
  ],
  ids=[
    "budget-below-one-step",
    "expert-larger-than-budget",
    "unknown-mode",
    "unknown-domain",
    "per-corpus-bpe",
    "unknown-rule",
    "unknown-size",
  ],
)
def test_bad_recipe_configs(overrides, match, tmp_path):
  """Refused before any domain's data is prepared (an empty cache stays empty) or anything is
  written."""
  config = tiny(**overrides)
  config.data.cache_dir = str(tmp_path / "cache")
  with pytest.raises(ValueError, match=match) as info:
    recipe.train_and_evaluate(config, str(tmp_path / "W"))
  assert "\n" not in str(info.value)
  assert not (tmp_path / "W").exists()  # nothing written
  assert not list((tmp_path / "cache").rglob("*")), "data was prepared before the refusal"


def test_bench_counts_domains_where_a_heterogeneous_ensemble_is_lowest(tmp_path):
  from bench.ensemble import hdee as bench

  rules = ("simple_avg", "uniform_prior")
  # domain a: M_Ho-I_He lowest under both rules; domain b: the homogeneous ensemble lowest
  ppl = {
    "a": {"M_Ho-I_Ho": 10.0, "M_Ho-I_He": 9.0, "M_He-I_Ho": 11.0},
    "b": {"M_Ho-I_Ho": 5.0, "M_Ho-I_He": 6.0, "M_He-I_Ho": 7.0},
  }
  seeds = []
  for shift in (0.0, 0.5, 100.0):  # the median ignores the outlying third seed
    seeds.append(
      {
        "domains": {"a": {"group": "hard", "iteration": 1}, "b": {"group": "easy", "iteration": 0}},
        "ppl": {
          **{
            lab: {r: {d: ppl[d][lab] + shift for d in ppl} for r in rules} for lab in bench.LABELS
          },
          "dense": {"a": 9.5 + shift, "b": 4.0 + shift},
          "seed-M": {"a": 20.0, "b": 20.0},
        },
      }
    )
  s = bench.summarize(seeds)
  assert s["hetero_lowest"] == {"simple_avg": 1, "uniform_prior": 1, "best_rule": 1}
  assert s["ensemble_beats_dense"]["simple_avg"] == 1  # a: 9.5 < 10; b: dense 4.5 < 5.5
  assert (
    s["rows"][0]["M_Ho-I_He/simple_avg"] == 9.5 and s["rows"][0]["lowest/simple_avg"] == "M_Ho-I_He"
  )
  assert "heterogeneous ensemble lowest in 1 of 2" in bench.table(s, "simple_avg")
