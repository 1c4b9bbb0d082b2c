"""What a run reports: held-out evaluation, the sample, and the summary of a finished run.

:func:`evaluate` runs the model (or its blocks in a given layer order) on the first
``train.eval_batches`` held-out batches; :func:`sample` writes ``sample.txt``; :func:`finished` is
what a rerun of a finished run prints, from its checkpoint and ``metrics.jsonl``, without training.
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import data, layers, model, parallel, sampling
from acco_jax.family_api import Run
from acco_jax.run import metrics as metrics_lib
from acco_jax.run import streams


def eval_function(cfg: model.ModelConfig, order=None):
  """Jitted ``(params, batch) -> aux`` of the model, or of its blocks run in ``order`` (int array of
  block indices: a half model, a SkipPipe path; None runs every block in order)."""
  if order is None:
    return jax.jit(lambda p, b: model.loss_fn(p, cfg, b)[1])
  order = jnp.asarray(order, jnp.int32)
  return jax.jit(lambda p, b: layers.loss_fn_ordered(p, cfg, b, order)[1])


def evaluate(run: Run, config, params, eval_fn=None, order=None) -> dict:
  """Mean token loss and perplexity of ``params`` on the first ``eval_batches`` held-out batches.

  ``eval_fn`` defaults to :func:`eval_function` of ``order`` (the full model when None).
  """
  if eval_fn is None:
    eval_fn = eval_function(run.model_cfg, order)
  it = streams.eval_stream(run, config)
  loss_sum = tokens = 0.0
  for _ in range(config.train.eval_batches):
    batch = parallel.global_batch(next(it), run.mesh, run.batch_axis, run.batch_whole)
    aux = jax.device_get(eval_fn(params, batch))
    loss_sum, tokens = loss_sum + float(aux["loss_sum"]), tokens + float(aux["tokens"])
  loss = loss_sum / max(tokens, 1.0)
  return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def sample(run: Run, config, params, workdir: str) -> str:
  """A sample from ``params`` after the config's prompt, printed and written to sample.txt."""
  tok = run.tokens.tokenizer
  prompt = np.asarray(tok.encode(config.train.sample_prompt) or [tok.eot_id], np.int32)
  out = sampling.generate(
    params,
    run.model_cfg,
    prompt,
    config.train.sample_tokens,
    jax.random.key(config.train.seed),
    temperature=0.8,
    top_k=40,
    window=config.data.seq_len,
  )
  text = tok.decode([int(t) for t in np.asarray(out).reshape(-1)])
  with open(os.path.join(workdir, "sample.txt"), "w") as f:
    f.write(text + "\n")
  print(f"sample: {text!r}", flush=True)
  return text


def describe_examples(run: Run, config) -> str:
  """One line on instruction data: examples, and those cut at or dropped for ``data.seq_len``."""
  from acco_jax.data import examples as examples_lib

  seq = config.data.seq_len
  tokens = run.tokens
  cut, dropped = examples_lib.truncation(tokens.train, seq)
  cut_eval, dropped_eval = examples_lib.truncation(tokens.eval, seq)
  rows = "packed rows" if config.data.packing else f"rows in buckets of {config.data.bucket}"
  return (
    f"instruction data {tokens.source}: {len(tokens.train)} train / {len(tokens.eval)} held-out "
    f"examples in {rows}; longer than data.seq_len={seq} and cut there: {cut} / {cut_eval}, of "
    f"which dropped (no response left): {dropped} / {dropped_eval}"
  )


def answers(run: Run, config, params, workdir: str | None, lead: bool = True) -> dict:
  """Exact match of greedy replies to the first ``train.answer_prompts`` held-out prompts of
  instruction data: the reply (up to the end-of-text, ``train.answer_tokens`` at most) stripped
  of surrounding white space against the reference answer, likewise. Writes every prompt, answer
  and reply to ``<workdir>/samples.jsonl`` and prints a few."""
  from acco_jax.data import examples as examples_lib

  tok, held = run.tokens.tokenizer, run.tokens.eval
  n = min(int(config.train.answer_prompts), len(held))
  prompts = [examples_lib.prompt_ids(held, i) for i in range(n)]
  max_new, window = int(config.train.answer_tokens), config.data.seq_len
  stop = getattr(run.tokens, "stop_ids", ()) or tok.eot_id
  replies = sampling.greedy(params, run.model_cfg, prompts, max_new, stop, window=window)
  rows = []
  for (prompt, answer), reply in zip(run.tokens.answers[:n], replies, strict=True):
    text = tok.decode(reply)
    exact = text.strip() == answer.strip()
    rows.append({"prompt": prompt, "answer": answer, "reply": text, "exact": exact})
  if workdir is not None and lead:
    with open(os.path.join(workdir, "samples.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  exact = sum(r["exact"] for r in rows) / max(len(rows), 1)
  if lead:
    for r in rows[:3]:
      lines = r["prompt"].strip().splitlines()
      asked = lines[-2] if len(lines) > 1 else lines[-1]
      reply = r["reply"].strip()
      print(f"answer: {asked!r} -> {reply!r} (reference {r['answer']!r})", flush=True)
    print(f"exact match {exact:.1%} of {len(rows)} held-out prompts", flush=True)
  return {"exact_match": exact, "answer_prompts": len(rows)}


# The order of a run's summary keys, fixed here rather than by when each value arrived: a run that
# evaluates only at its end gets its evaluation after a LoCo method's byte counts, one that
# evaluates on the way (or the rerun of a finished run) before them, and a resumed run may evaluate
# before its first log line. Keys not listed follow in the order they came.
SUMMARY_KEYS = (
  "unigram_baseline",
  "loss",
  "tokens_per_s",
  "eval_loss",
  "eval_ppl",
  "exact_match",
  "wire_bytes_per_worker",
  "peak_sync_bytes",
  "payload_bytes_per_sync",
  "sent_density",
  "stages",
  "updates",
  "stopped",
  "sample",
)


def in_order(summary: dict) -> dict:
  """``summary`` with its keys in the order of :data:`SUMMARY_KEYS`."""
  known = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
  return {**known, **{k: v for k, v in summary.items() if k not in known}}


def finished(run: Run, config, workdir: str, stage: int, wire_bytes: float, lead: bool) -> dict:
  """The summary of a run whose checkpoint is at (or past) its last stage, from the checkpoint and
  ``metrics.jsonl``, with the keys the run printed when it finished; no step runs."""
  logged = metrics_lib.last_logged(workdir)
  at = logged.pop("eval_step", None)
  summary = {"unigram_baseline": data.unigram_entropy(data.loss_tokens(run.tokens.train)), **logged}
  summary.update(run.step.summary(wire_bytes))
  summary.update(stages=stage, updates=run.updates_done(stage))
  sample_path = os.path.join(workdir, "sample.txt")
  if config.train.sample_tokens and os.path.exists(sample_path):
    with open(sample_path) as f:
      summary["sample"] = f.read().rstrip("\n")
  summary = in_order(summary)
  if lead:
    where = f"at stage {stage}/{run.total_stages}"
    if stage > run.total_stages:
      where = f"at stage {stage}, past this config's {run.total_stages} stages"
    final = "no evaluation in metrics.jsonl"
    if "eval_loss" in logged:
      final = f"eval_loss={logged['eval_loss']:.4f} (stage {at}, metrics.jsonl)"
    print(f"nothing to train: the run finished {where}; final evaluation {final}", flush=True)
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}), flush=True)
  return summary
