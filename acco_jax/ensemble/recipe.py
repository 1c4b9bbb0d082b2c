"""The HDEE recipe from one config: seeds, then iterations of independent experts, then evaluation.

``train_and_evaluate(config, workdir)`` is what ``train.py`` calls for ``method=hdee``. Every
training job (a seed model, one expert on one domain, the dense reference) is an ordinary run of the
project's trainer in its own sub-workdir, ``<workdir>/<job>``: its checkpoints, metrics and resume
are the trainer's. A finished job leaves ``params.npz`` (its final parameters), which the next
iteration of the same expert starts from. Rerunning the command skips finished jobs, resumes the one
in progress from its checkpoint, and evaluates at the end. ``hdee.jobs`` (globs over job names)
gives a run a share of the jobs: runs on other processes or hosts share the workdir (a shared
filesystem), each trains its share, and the run that finds every job done evaluates.

Why a run per job rather than the experts as device groups of one job: the experts share nothing
while they train, so separate runs are the simplest form of that independence. A job needs only
its parent's ``params.npz``: chains of experts run in separate processes or hosts, each resumes on
its own, and an expert of another size is another run (one program would need one shape).

Layout of ``<workdir>``: ``recipe.json`` (the config, checked on resume), ``mixture.txt`` (the
trained domains' training documents, interleaved: the seeds' and the dense model's corpus),
``seed-<size>/``, ``<mode>/<group>-<iteration>/``, ``dense/``, ``difficulty.json``
(``difficulty=measured``), ``results.json`` and ``results.md`` (perplexities),
``sample-<mode>.txt``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

import jax
import ml_collections
import numpy as np

from acco_jax import data, errors, model
from acco_jax.data import sources as sources_lib
from acco_jax.data.tokenizer import declared_vocab_size
from acco_jax.ensemble import budgets, domains, infer, mixing
from acco_jax.ensemble import jobs as jobs_lib
from acco_jax.run import compile_cache

_FIXED = ("hdee",)  # groups whose change would make the workdir's jobs inconsistent
_PER_RUN = ("jobs",)  # hdee fields each process may set differently (its share of the jobs)


@dataclasses.dataclass
class Plan:
  """Everything ``train_and_evaluate`` needs, validated before anything is written."""

  config: ml_collections.ConfigDict
  experts: list[budgets.Expert]
  domains: list[budgets.Domain]
  sizes: dict[str, dict[str, int]]
  model_cfgs: dict[str, model.ModelConfig]
  tokens: dict[str, data.TokenData]  # per domain name
  source_of: dict[str, str]
  tokens_per_step: int
  seeds: list[budgets.Job]
  modes: list[str]
  rules: list[str]
  dense: budgets.Job | None


def _cache_dir(config) -> str:
  return config.data.cache_dir or os.path.expanduser("~/.cache/acco_jax")


def _data_dir(config, source: str) -> str | None:
  """Where the pipeline keeps a source's prepared files (as `acco_jax.data.prepare` chooses)."""
  if source.startswith("text:"):
    return config.data.data_dir or os.path.join(_cache_dir(config), "text_tfds")
  return config.data.data_dir or None


def _list(spec: str) -> list[str]:
  return [s.strip() for s in spec.split(",") if s.strip()]


def _model_cfg(config, overrides: dict[str, int], vocab: int) -> model.ModelConfig:
  """A size class's model: ``model.arch``'s preset ``model.size``, the config's sizes, then the
  class's (the same model each expert job's trainer run builds from its config)."""
  if config.model.get("init"):
    raise errors.UserValueError(
      f"model.init={config.model.init}: HDEE's experts start from its seed models; train the "
      "recipe from scratch (model.init='')"
    )
  fields = {k: config.model[k] for k in ("D", "N", "H", "F", "kv_heads") if config.model.get(k)}
  fields.update(overrides)
  return model.get_config(
    config.model.size,
    arch=config.model.get("arch", "gpt2"),
    V=vocab,
    L=config.data.seq_len,
    dtype=config.model.dtype,
    attention=config.model.attention,
    vocab_multiple=config.model.get("vocab_multiple", 1),
    **fields,
  )


def _tokens(config, name: str, source: str) -> data.TokenData:
  try:
    tok = data.prepare(
      source,
      config.data.tokenizer,
      cache_dir=_cache_dir(config),
      eval_fraction=config.data.eval_fraction,
      seed=config.data.split_seed,
      data_dir=config.data.data_dir or None,
      text_key=config.data.text_key,
    )
  except errors.UserError as e:
    raise type(e)(f"hdee domain {name!r}: {e}") from None
  seq = config.data.seq_len
  if len(data.pack(tok.eval, seq)) < 1 or len(data.pack(tok.train, seq)) < 1:
    raise errors.UserValueError(
      f"hdee domain {name!r} has too little text for one row of {seq + 1} tokens in its train "
      "and eval splits: give it more text"
    )
  return tok


def make_plan(config, *, prepare: bool = True) -> Plan:
  """Parses and checks the ``hdee`` group (every one-line refusal before any data), then prepares
  every domain's tokens (cache only; not with ``prepare=False``: :func:`prepare_domains`)."""
  h = config.hdee
  if config.data.tokenizer.startswith("bpe:") and config.data.tokenizer[4:].isdigit():
    raise errors.UserValueError(
      f"data.tokenizer={config.data.tokenizer!r} is trained per corpus, so the experts would not "
      "share a vocabulary: use byte, gpt2 or bpe:<path.json>"
    )
  modes = [budgets.check_mode(m) for m in _list(h.modes)]
  if not modes:
    raise errors.UserValueError(f"hdee.modes is empty: choose from {', '.join(budgets.MODES)}")
  rules = _list(h.mixing)
  for r in rules:
    if r not in mixing.RULES:
      raise errors.UserValueError(
        f"hdee.mixing: unknown rule {r!r}: choose from {', '.join(mixing.RULES)}"
      )
  if h.difficulty not in ("groups", "measured"):
    raise errors.UserValueError(f"hdee.difficulty={h.difficulty!r}: choose 'groups' or 'measured'")
  if not 0 < h.prior_decay <= 1 or h.prior_sequences < 1 or h.eval_sequences < 1:
    raise errors.UserValueError(
      f"hdee.prior_decay={h.prior_decay} must be in (0, 1], hdee.prior_sequences and "
      "hdee.eval_sequences >= 1"
    )
  if h.seed_updates < 1:
    raise errors.UserValueError(f"hdee.seed_updates={h.seed_updates} must be >= 1")
  experts = budgets.parse_experts(h.experts)
  groups = [e.group for e in experts]
  sizes = budgets.parse_sizes(h.sizes)
  for size in {e.size for e in experts} | {h.homogeneous_size}:
    if size not in sizes:
      raise errors.UserValueError(
        f"size {size!r} (hdee.experts / hdee.homogeneous_size) is not a class of hdee.sizes "
        f"({', '.join(sizes) or 'none'}): use one of them, or add a class such as "
        f"{size}:F=<width> (fields D, N, H, F) to hdee.sizes"
      )
  weights = budgets.parse_weights(h.step_weights, groups)
  doms = budgets.parse_domains(h.domains, groups)
  # the budgets need the models' sizes only: the tokenizer's declared vocabulary, no data yet
  vocab = declared_vocab_size(config.data.tokenizer)
  model_cfgs = {name: _model_cfg(config, o, vocab) for name, o in sizes.items()}
  n_dev = config.mesh.num_devices or jax.device_count()
  T = n_dev * config.batch.microbatches * config.batch.microbatch_size * config.data.seq_len
  fpt = {s: model.flops_per_token(c, config.data.seq_len) for s, c in model_cfgs.items()}
  kw = dict(
    flops_per_token=fpt,
    tokens_per_step=T,
    budget_flops=float(h.budget_flops),
    homogeneous_size=h.homogeneous_size,
    step_weights=weights,
  )
  for m in modes:  # every budget error now, before anything runs
    budgets.expert_jobs(m, experts, doms, **kw)
  needed = {h.homogeneous_size} if set(modes) - {"sizes"} or h.dense else set()
  if "sizes" in modes:
    needed |= {e.size for e in experts}
  seed_fpt = lambda s: fpt[s] * T * h.seed_updates  # noqa: E731
  seeds = [
    budgets.Job(f"seed-{s}", s, "mixture", h.seed_updates, seed_fpt(s), "")
    for s in sorted(needed, key=list(sizes).index)
  ]
  dense = None
  if h.dense:
    dense = budgets.dense_job(h.homogeneous_size, fpt[h.homogeneous_size], T, h.budget_flops)
  plan = Plan(config, experts, doms, sizes, model_cfgs, {}, {}, T, seeds, modes, rules, dense)
  return prepare_domains(plan) if prepare else plan


def prepare_domains(plan: Plan) -> Plan:
  """``plan`` with every domain's source and tokens (the cache's; prepared once)."""
  config, h = plan.config, plan.config.hdee
  cache = _cache_dir(config)  # every refusal of make_plan came before this: the domains' data
  source_of = {
    d.name: domains.source(d.name, d.source, cache, h.max_domain_chars) for d in plan.domains
  }
  tokens = {d.name: _tokens(config, d.name, source_of[d.name]) for d in plan.domains}
  vocab = declared_vocab_size(config.data.tokenizer)
  if {t.tokenizer.vocab_size for t in tokens.values()} != {vocab}:
    raise RuntimeError(f"the domains' tokenizers do not have the declared {vocab} ids")
  return dataclasses.replace(plan, tokens=tokens, source_of=source_of)


def expert_jobs(plan: Plan, mode: str, doms: list[budgets.Domain]) -> list[budgets.Job]:
  h = plan.config.hdee
  fpt = {s: model.flops_per_token(c, plan.config.data.seq_len) for s, c in plan.model_cfgs.items()}
  return budgets.expert_jobs(
    mode,
    plan.experts,
    doms,
    flops_per_token=fpt,
    tokens_per_step=plan.tokens_per_step,
    budget_flops=float(h.budget_flops),
    homogeneous_size=h.homogeneous_size,
    step_weights=budgets.parse_weights(h.step_weights, [e.group for e in plan.experts]),
  )


def _check_recipe(config, workdir: str) -> None:
  path = os.path.join(workdir, "recipe.json")
  if not os.path.isfile(path):
    return
  with open(path) as f:
    saved = json.load(f)
  now = json.loads(config.to_json_best_effort())
  diff = sorted(
    f"{g}.{k}"
    for g in _FIXED
    for k in set(saved.get(g, {})) | set(now.get(g, {}))
    if k not in _PER_RUN and saved.get(g, {}).get(k) != now.get(g, {}).get(k)
  )
  for g in ("model", "data", "batch", "opt", "mesh"):
    diff += [f"{g}.{k}" for k in now.get(g, {}) if saved.get(g, {}).get(k) != now[g][k]]
  if diff:
    raise errors.UserValueError(
      f"{workdir!r} holds an HDEE recipe with another config ({', '.join(diff)} differ): rerun "
      "with the same config, or start in a new workdir"
    )


def _write_json(path: str, obj) -> None:
  tmp = f"{path}.{uuid.uuid4().hex}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def _rows(tokens: np.ndarray, seq_len: int, n: int) -> np.ndarray:
  return np.asarray(data.pack(tokens, seq_len)[:n], np.int32)


def train_and_evaluate(config, workdir: str, *, interrupt: tuple[str, int] | None = None) -> dict:
  """Runs (or resumes) the whole recipe in ``workdir``; returns the results.

  Args:
    config: a config with an ``hdee`` group (configs/hdee.py).
    workdir: the recipe's directory.
    interrupt: ``(job name, stages)``: stop that job after that many stages, with its checkpoint,
      and return ``{}`` (what a kill after a checkpoint leaves; tests only).
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.UserValueError(f"workdir {workdir!r} is a file: pass --workdir a directory")
  if config.ckpt.get("init_from"):  # every job's config is a copy of this one
    raise errors.UserValueError(
      "ckpt.init_from does not apply to method=hdee: its experts start from the recipe's seed "
      "models; leave it ''"
    )
  compile_cache.configure(config.compile.cache_dir)
  _check_recipe(config, workdir)
  plan = make_plan(config, prepare=False)
  h = config.hdee
  every = plan.seeds + [j for m in plan.modes for j in expert_jobs(plan, m, plan.domains)]
  every += [plan.dense] if plan.dense else []  # names do not depend on difficulty=measured
  mine = jobs_lib.selector(_list(h.jobs), every, workdir)  # before any data or anything written
  plan = prepare_domains(plan)
  os.makedirs(workdir, exist_ok=True)
  mixture = os.path.join(workdir, "mixture.txt")
  if not os.path.isfile(mixture):  # training documents only: the eval splits stay unseen
    trained = [d for d in plan.domains if d.iteration]
    docs = [
      data.split_documents(
        sources_lib.load_documents(
          plan.source_of[d.name],
          data_dir=_data_dir(config, plan.source_of[d.name]),
          text_key=config.data.text_key,
        ),
        config.data.eval_fraction,
        config.data.split_seed,
      )[0]
      for d in trained
    ]
    domains.write_mixture(mixture, docs)
  plan.source_of["mixture"] = f"text:{mixture}"

  def train(job: budgets.Job) -> bool:
    stop = interrupt[1] if interrupt and interrupt[0] == job.name else None
    return jobs_lib.run_job(plan, workdir, job, plan.source_of[job.domain], stop)

  pending = []  # jobs left to other runs (hdee.jobs)
  for job in plan.seeds:
    if not mine(job):
      pending += [] if jobs_lib.done(workdir, job) else [job.name]
    elif not train(job):
      return {}
  recipe = os.path.join(workdir, "recipe.json")  # once a job has run with this config
  if not os.path.isfile(recipe):
    _write_json(recipe, json.loads(config.to_json_best_effort()))
  doms = plan.domains
  if h.difficulty == "measured":
    if pending:
      return jobs_lib.left_to_others(pending, "the seeds rank the domains (difficulty=measured)")
    doms = _measured(plan, workdir)
  jobs = [j for m in plan.modes for j in expert_jobs(plan, m, doms)]
  for job in jobs + ([plan.dense] if plan.dense else []):
    if not mine(job):
      pending += [] if jobs_lib.done(workdir, job) else [job.name]
    elif not train(job):
      return {}
  if pending:
    return jobs_lib.left_to_others(pending, "evaluation runs once every job is done")
  results = evaluate(plan, workdir, doms, jobs)
  _write_json(os.path.join(workdir, "results.json"), results)
  table = results_table(results)
  with open(os.path.join(workdir, "results.md"), "w") as f:
    f.write(table + "\n")
  print(table, flush=True)
  if config.train.sample_tokens:
    _samples(plan, workdir, jobs)
  return results


def _measured(plan: Plan, workdir: str) -> list[budgets.Domain]:
  """Regroups the trained domains by the homogeneous-size seed's loss (difficulty.json)."""
  path = os.path.join(workdir, "difficulty.json")
  if os.path.isfile(path):
    with open(path) as f:
      losses = json.load(f)["seed_loss"]
  else:
    size = plan.config.hdee.homogeneous_size
    params = jobs_lib.load_params(
      os.path.join(workdir, f"seed-{size}", "params.npz"), plan.model_cfgs[size]
    )
    losses = {}
    for d in plan.domains:
      if d.iteration:
        rows = _rows(
          plan.tokens[d.name].train, plan.config.data.seq_len, plan.config.hdee.prior_sequences
        )
        losses[d.name] = -float(np.mean(infer.token_log_probs(params, plan.model_cfgs[size], rows)))
  groups = [e.group for e in plan.experts]
  doms = budgets.measured_groups(plan.domains, losses, groups)
  _write_json(path, {"seed_loss": losses, "groups": {d.name: [d.group, d.iteration] for d in doms}})
  return doms


def evaluate(plan: Plan, workdir: str, doms, jobs) -> dict:
  """Per-domain perplexities of the seeds, the dense model, every expert and every ensemble."""
  h, seq = plan.config.hdee, plan.config.data.seq_len
  eval_rows = {d.name: _rows(plan.tokens[d.name].eval, seq, h.eval_sequences) for d in doms}
  dev_rows = {d.name: _rows(plan.tokens[d.name].train, seq, h.prior_sequences) for d in doms}

  def score(job_name: str, size: str):
    params = jobs_lib.load_params(
      os.path.join(workdir, job_name, "params.npz"), plan.model_cfgs[size]
    )
    cfg = plan.model_cfgs[size]
    ev = {n: infer.token_log_probs(params, cfg, r) for n, r in eval_rows.items()}
    dev = {n: infer.token_log_probs(params, cfg, r).sum(-1) for n, r in dev_rows.items()}
    return ev, dev

  results = {
    "domains": {d.name: {"group": d.group, "iteration": d.iteration} for d in doms},
    "plan": [j._asdict() for j in plan.seeds + jobs + ([plan.dense] if plan.dense else [])],
    "tokens_per_step": plan.tokens_per_step,
    "budget_flops": float(h.budget_flops),
    "ppl": {},
    "experts": {},
    "priors": {},
  }
  for job in plan.seeds + ([plan.dense] if plan.dense else []):
    ev, _ = score(job.name, job.size)
    results["ppl"][job.name] = {n: infer.perplexity(v) for n, v in ev.items()}
  iters = budgets.num_iterations(doms)
  for mode in plan.modes:
    label = budgets.MODE_LABELS[mode]
    finals = [j for j in jobs if j.name.startswith(f"{mode}/") and j.name.endswith(f"-{iters}")]
    scored = [score(j.name, j.size) for j in finals]
    results["experts"][label] = {
      j.name: {n: infer.perplexity(v) for n, v in ev.items()}
      for j, (ev, _) in zip(finals, scored, strict=True)
    }
    per_rule: dict[str, dict[str, float]] = {r: {} for r in plan.rules}
    results["priors"][label] = {}
    for d in doms:
      logp = np.stack([ev[d.name] for ev, _ in scored])
      dev = np.stack([dv[d.name] for _, dv in scored])
      ppl, prior = infer.ensemble_perplexities(logp, dev, plan.rules, h.prior_decay)
      for r in plan.rules:
        per_rule[r][d.name] = ppl[r]
      if prior is not None:
        results["priors"][label][d.name] = prior
    results["ppl"][label] = per_rule
  return results


def results_table(results: dict) -> str:
  """A markdown table: per domain, each ensemble under each rule, the dense model and the seeds."""
  labels = [v for v in budgets.MODE_LABELS.values() if v in results["ppl"]]
  rules = list(results["ppl"][labels[0]]) if labels else []
  others = [k for k in results["ppl"] if k not in labels]
  head = ["domain", "group", "it"] + [f"{lab} {r}" for r in rules for lab in labels] + others
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, d in results["domains"].items():
    cells = [name, d["group"], str(d["iteration"]) if d["iteration"] else "held-out"]
    cells += [f"{results['ppl'][lab][r][name]:.3f}" for r in rules for lab in labels]
    cells += [f"{results['ppl'][o][name]:.3f}" for o in others]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _samples(plan: Plan, workdir: str, jobs) -> None:
  c = plan.config
  tok = next(iter(plan.tokens.values())).tokenizer
  prompt = tok.encode(c.train.sample_prompt) or [tok.eot_id]
  iters = max(int(j.name.rsplit("-", 1)[1]) for j in jobs)
  for mode in plan.modes:
    finals = [j for j in jobs if j.name.startswith(f"{mode}/") and j.name.endswith(f"-{iters}")]
    experts = [
      (
        jobs_lib.load_params(os.path.join(workdir, j.name, "params.npz"), plan.model_cfgs[j.size]),
        plan.model_cfgs[j.size],
      )
      for j in finals
    ]
    out = infer.generate(experts, prompt, c.train.sample_tokens, c.train.seed, temperature=0.8)
    text = tok.decode([int(t) for t in out])
    with open(os.path.join(workdir, f"sample-{mode}.txt"), "w") as f:
      f.write(text + "\n")
    print(f"sample ({budgets.MODE_LABELS[mode]}, uniform_prior): {text!r}", flush=True)
