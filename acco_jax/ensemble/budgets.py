"""The recipe as data: experts, domains, and each job's steps from a FLOP budget (pure Python).

An HDEE recipe has one expert per difficulty group (``hard:L,medium:M,easy:S``, hardest first)
and domains tagged ``group:iteration:name[=source]``. Iteration i = 1..I of group g is the domain
expert g trains on in its i-th continuation; iteration 0 marks a held-out domain (evaluated,
never trained). The training budget B is in FLOPs, ``flops_per_token(size) * tokens`` summed over
every (expert, iteration) job; the project's ``flops_per_token`` is 6 x the matmul weights plus
the attention scores, the paper's ``6 * params`` up to the attention term. With T tokens per step
and c_j = flops_per_token(size_j) * T the cost of one step of job j:

* ``homogeneous`` (M_Ho-I_Ho): every expert the homogeneous size, every job the same steps
  ``n = floor(B / sum_j c_j)``;
* ``steps`` (M_Ho-I_He): the homogeneous size, steps proportional to the group's weight w_g,
  ``n_j = floor(w_j * B / sum_j w_j c_j)`` (more steps for harder groups);
* ``sizes`` (M_He-I_Ho): each expert its own size, the same steps ``n = floor(B / sum_j c_j)``.

Every mode spends at most B, and within one step of each job of it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from acco_jax import errors

MODES = ("homogeneous", "steps", "sizes")
MODE_LABELS = {"homogeneous": "M_Ho-I_Ho", "steps": "M_Ho-I_He", "sizes": "M_He-I_Ho"}
_MODEL_FIELDS = ("D", "N", "H", "F")


class Domain(NamedTuple):
  name: str
  group: str
  iteration: int  # 1..I: trained in that iteration; 0: held out
  source: str  # '' for a built-in domain (acco_jax.ensemble.domains)


class Expert(NamedTuple):
  group: str
  size: str  # a size class of `parse_sizes` (used in mode 'sizes')


class Job(NamedTuple):
  """One expert's training on one domain: a trainer run of its own."""

  name: str  # sub-workdir, e.g. 'steps/hard-2'
  size: str
  domain: str  # a domain name, or 'mixture' (seeds, dense)
  steps: int
  flops: float  # flops_per_token * tokens of the whole job
  init: str  # the job whose final parameters it starts from ('' = fresh)


def _pairs(spec: str, what: str) -> list[tuple[str, str]]:
  out = []
  for item in filter(None, (s.strip() for s in spec.split(","))):
    key, sep, value = item.partition(":")
    if not sep or not key or not value:
      raise errors.UserValueError(f"{what}: {item!r} is not key:value (e.g. {_EXAMPLES[what]})")
    out.append((key.strip(), value.strip()))
  if not out:
    raise errors.UserValueError(f"{what} is empty: give e.g. {_EXAMPLES[what]}")
  return out


_EXAMPLES = {
  "hdee.experts": "hard:L,medium:M,easy:S",
  "hdee.step_weights": "hard:1.25,medium:1,easy:0.75",
  "hdee.sizes": "S:F=336;M:F=512;L:F=640",
  "hdee.domains": "hard:1:code_asyncio,easy:0:kjv_gospels",
}


def parse_experts(spec: str) -> list[Expert]:
  """``'hard:L,medium:M,easy:S'``: one expert per group, hardest group first."""
  experts = [Expert(g, s) for g, s in _pairs(spec, "hdee.experts")]
  groups = [e.group for e in experts]
  if len(set(groups)) != len(groups):
    raise errors.UserValueError(f"hdee.experts={spec!r}: one expert per group, each group once")
  return experts


def parse_weights(spec: str, groups: list[str]) -> dict[str, float]:
  """``'hard:1.25,medium:1,easy:0.75'``: the relative steps of each group (mode 'steps')."""
  weights = {}
  for g, w in _pairs(spec, "hdee.step_weights"):
    try:
      weights[g] = float(w)
    except ValueError:
      raise errors.UserValueError(
        f"hdee.step_weights: {w!r} of group {g!r} is not a number"
      ) from None
  missing = [g for g in groups if g not in weights]
  bad = {g: w for g, w in weights.items() if not w > 0}
  if missing or bad:
    raise errors.UserValueError(
      f"hdee.step_weights={spec!r}: give every expert group ({', '.join(groups)}) a weight > 0"
    )
  return weights


def parse_sizes(spec: str) -> dict[str, dict[str, int]]:
  """``'S:F=336;M:F=512;L:D=128/F=640'``: size classes as model overrides (D, N, H, F)."""
  sizes = {}
  for item in filter(None, (s.strip() for s in spec.split(";"))):
    name, sep, fields = item.partition(":")
    overrides = {}
    for field in filter(None, fields.split("/")):
      key, eq, value = field.partition("=")
      if key.strip() not in _MODEL_FIELDS or not eq or not value.strip().isdigit():
        raise errors.UserValueError(
          f"hdee.sizes: {field!r} of size {name!r} must be one of {'/'.join(_MODEL_FIELDS)}=<int> "
          f"(e.g. {_EXAMPLES['hdee.sizes']})"
        )
      overrides[key.strip()] = int(value)
    if not sep or not name.strip():
      raise errors.UserValueError(
        f"hdee.sizes: {item!r} is not name:fields (e.g. {_EXAMPLES['hdee.sizes']})"
      )
    sizes[name.strip()] = overrides
  return sizes


def parse_domains(spec: str, groups: list[str]) -> list[Domain]:
  """``'hard:1:code_asyncio,...,easy:0:kjv_gospels,hard:2:mine=text:/data/*.txt'``.

  Every group needs exactly one domain per iteration 1..I (the same I for all groups).
  """
  domains = []
  for item in filter(None, (s.strip() for s in spec.split(","))):
    parts = item.split(":", 2)
    if len(parts) != 3 or not parts[1].strip().isdigit() or not parts[2].strip():
      raise errors.UserValueError(
        f"hdee.domains: {item!r} is not group:iteration:name[=source] "
        f"(e.g. {_EXAMPLES['hdee.domains']})"
      )
    group, iteration, rest = parts[0].strip(), int(parts[1]), parts[2].strip()
    name, _, source = rest.partition("=")
    if group not in groups:
      raise errors.UserValueError(
        f"hdee.domains: domain {name!r} is in group {group!r}, which has no expert "
        f"(hdee.experts has {', '.join(groups)})"
      )
    domains.append(Domain(name.strip(), group, iteration, source.strip()))
  names = [d.name for d in domains]
  if len(set(names)) != len(names) or "mixture" in names:
    raise errors.UserValueError("hdee.domains: domain names must be unique and not 'mixture'")
  iterations = num_iterations(domains)
  for g in groups:
    have = sorted(d.iteration for d in domains if d.group == g and d.iteration)
    if have != list(range(1, iterations + 1)):
      raise errors.UserValueError(
        f"hdee.domains: group {g!r} trains on iterations {have}; every group needs one domain "
        f"for each iteration 1..{iterations}"
      )
  return domains


def num_iterations(domains: list[Domain]) -> int:
  return max((d.iteration for d in domains), default=0)


def check_mode(mode: str) -> str:
  if mode not in MODES:
    raise errors.UserValueError(
      f"hdee.modes: unknown mode {mode!r}: choose from {', '.join(MODES)}"
    )
  return mode


def expert_jobs(
  mode: str,
  experts: list[Expert],
  domains: list[Domain],
  *,
  flops_per_token: dict[str, float],
  tokens_per_step: int,
  budget_flops: float,
  homogeneous_size: str,
  step_weights: dict[str, float],
) -> list[Job]:
  """The (expert, iteration) jobs of one ensemble, with the steps the budget buys (module doc).

  Args:
    mode: one of `MODES`.
    experts: one per group.
    domains: the trained domains (iteration >= 1) define the jobs.
    flops_per_token: training FLOPs per token of each size class.
    tokens_per_step: T, tokens of one optimizer step.
    budget_flops: B, the ensemble's total training FLOPs.
    homogeneous_size: the size of every expert in modes 'homogeneous' and 'steps'.
    step_weights: relative steps per group (mode 'steps').

  Returns:
    Jobs named ``<mode>/<group>-<iteration>``, in iteration-major order; each starts from the
    same expert's previous iteration, the first from ``seed-<size>``.
  """
  check_mode(mode)
  trained = sorted((d for d in domains if d.iteration), key=lambda d: d.iteration)
  size_of = {e.group: (e.size if mode == "sizes" else homogeneous_size) for e in experts}
  weight = lambda g: step_weights[g] if mode == "steps" else 1.0  # noqa: E731
  for e in experts:
    step = flops_per_token[size_of[e.group]] * tokens_per_step
    if step > budget_flops:
      raise errors.UserValueError(
        f"expert {e.group!r} of size {size_of[e.group]!r} needs {step:.3g} FLOPs for one step of "
        f"{tokens_per_step} tokens, more than hdee.budget_flops={budget_flops:.3g}: choose a "
        "smaller size or raise hdee.budget_flops"
      )
  costs = [flops_per_token[size_of[d.group]] * tokens_per_step for d in trained]
  weighted = sum(weight(d.group) * c for d, c in zip(trained, costs, strict=True))
  jobs = []
  for d, c in zip(trained, costs, strict=True):
    steps = math.floor(weight(d.group) * budget_flops / weighted)
    if steps < 1:
      raise errors.UserValueError(
        f"hdee.budget_flops={budget_flops:.3g} buys mode {mode!r} less than one step of "
        f"{tokens_per_step} tokens for expert {d.group!r} (all its jobs need {weighted:.3g} per "
        "step): raise hdee.budget_flops or lower the batch"
      )
    prev = f"{mode}/{d.group}-{d.iteration - 1}" if d.iteration > 1 else f"seed-{size_of[d.group]}"
    jobs.append(
      Job(f"{mode}/{d.group}-{d.iteration}", size_of[d.group], d.name, steps, steps * c, prev)
    )
  return jobs


def dense_job(size: str, flops_per_token: float, tokens_per_step: int, budget_flops: float) -> Job:
  """One model of ``size`` on the mixture of the trained domains, with the ensembles' budget."""
  steps = math.floor(budget_flops / (flops_per_token * tokens_per_step))
  if steps < 1:
    raise errors.UserValueError(
      f"hdee.budget_flops={budget_flops:.3g} buys the dense model less than one step: raise it"
    )
  return Job(
    "dense", size, "mixture", steps, steps * flops_per_token * tokens_per_step, f"seed-{size}"
  )


def measured_groups(
  domains: list[Domain], losses: dict[str, float], groups: list[str]
) -> list[Domain]:
  """``difficulty=measured``: regroups the trained domains by the seed model's loss on them.

  The trained domains, sorted by loss (highest first), fill the groups in ``groups`` order
  (hardest first), each with as many domains as it had; within a group the domains keep the
  configured order of their iterations. Held-out domains keep their group.
  """
  trained = [d for d in domains if d.iteration]
  ranked = sorted(trained, key=lambda d: -losses[d.name])
  out, start = [], 0
  for g in groups:
    count = sum(1 for d in trained if d.group == g)
    chosen = sorted(ranked[start : start + count], key=lambda d: (d.iteration, d.name))
    out += [d._replace(group=g, iteration=i + 1) for i, d in enumerate(chosen)]
    start += count
  return out + [d for d in domains if not d.iteration]
