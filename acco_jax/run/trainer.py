"""The training loop: data, model, method, checkpoints and metrics, driven by a config.

``train_and_evaluate(config, workdir)`` is what ``train.py`` calls: it builds the run
(:func:`acco_jax.run.build.build`), restores or initialises its state (:mod:`acco_jax.run.start`)
and drives a :class:`Loop`. Reading order of the loop: :meth:`Loop.run` is the loop itself; each
pass is one call of the family's step (:meth:`Loop.call`), after which it may log a row
(:meth:`Loop.queue_row`, written by :meth:`Loop.write_row` once the next call is queued),
evaluate (:meth:`Loop.evaluate`), save (:meth:`Loop.save`) and stop (:meth:`Loop.stop`); a probe
(:meth:`Loop.probe`) may come before a call, and :meth:`Loop.finish` ends the run.

Units: a *stage* is one program call of ``k`` microbatches per device; an *update* is one
optimizer step (ACCO: a commit, every second stage; the others: every stage). Schedules, evaluation
and checkpoint periods count updates; the checkpoint step number counts stages. A family's step
(:class:`acco_jax.step_api.Step`) runs one or more stages a call (a LoCo window or phase runs
several inner steps in one program).
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax import data, errors, model
from acco_jax.run import (
  compile_cache,
  health,
  monitor,
  optim,
  parallel,
  profile,
  report,
)
from acco_jax.run import memory as memory_lib
from acco_jax.run import metrics as metrics_lib
from acco_jax.run import start as start_lib
from acco_jax.run.build import Run as Run
from acco_jax.run.build import batch_stream as batch_stream
from acco_jax.run.build import build as build
from acco_jax.run.build import check_vocab as check_vocab
from acco_jax.run.build import comm_meta, model_meta, updates_done, vocab_meta
from acco_jax.run.report import eval_function as eval_function
from acco_jax.run.report import evaluate as evaluate


@jax.jit
def _flag_nonfinite(flag, loss, finite):
  """``flag`` (``None`` before the first stage) or'ed with where ``loss`` or ``finite`` is not."""
  bad = ~(jnp.isfinite(loss) & finite)
  return bad if flag is None else flag | bad


def train_and_evaluate(
  config,
  workdir: str,
  *,
  max_stages: int | None = None,
  init_params=None,
  on_params=None,
  launch: health.Launch | None = None,
) -> dict:
  """Trains the config's model with its method; returns the final metrics.

  ``max_stages`` stops early (with a checkpoint) after that many stages in total, as a preemption
  would; rerunning continues the same trajectory. ``init_params`` (a parameter tree) replaces the
  random initialisation of a fresh run (a continued expert, acco_jax.ensemble); ``on_params`` is
  called with the final parameters once the run has finished (not when it stops early).
  ``launch``: this run's processes among those it was launched with, when ``health.exclude=auto``
  left some out (:func:`health.exclusion`).
  """
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.UserValueError(
      f"workdir {workdir!r} is a file: pass --workdir a directory (new or a run's)"
    )
  compile_cache.configure(config.compile.cache_dir)
  lead = jax.process_index() == 0
  memory_lib.fit_devices(config, lambda c: build(c, check_only=True), lead=lead)  # fit_memory
  run = build(config)
  loop = Loop(run, config, workdir)
  memory_lib.check_run(run, config, lead=lead)  # the predicted peak; refused if it cannot fit
  # -- restore or initialise (acco_jax.run.start); nothing written to the workdir before ---------
  origin = start_lib.restore_or_init(
    run, config, workdir, loop.stream, loop.rows_per_stage, init_params, loop.lead
  )
  if origin.stage >= run.total_stages:  # nothing left: report the finished run, train nothing
    if origin.ckpt is not None:
      origin.ckpt.close()
    if on_params is not None:  # a kill may have come between the last checkpoint and this call
      on_params(run.step.params(origin.state))
    sent = float(origin.extra.get("wire_bytes", 0.0))
    return report.finished(run, config, workdir, origin.stage, sent, loop.lead)
  loop.begin(origin, max_stages=max_stages, launch=launch)
  return loop.run(on_params)


def check_held_out(run: Run, config) -> None:
  """Refuses, before any work, held-out data that gives no evaluation batch (the final
  evaluation's stream, :func:`acco_jax.run.report.evaluate`'s, is built here and not read)."""
  rows = run.mesh.size * config.batch.microbatch_size
  try:
    batch_stream(run, config, run.tokens.eval, rows, seed=0, shuffle=False)
  except errors.UserValueError as e:
    raise errors.UserValueError(
      f"the held-out split (data.eval_fraction={config.data.eval_fraction}): {e}; or raise "
      "data.eval_fraction"
    ) from None


class Loop:
  """One run of the stage loop over a built :class:`acco_jax.run.build.Run` (see the module
  docstring for its reading order).

  Attributes:
    stage: stages done; ``tokens_seen``: tokens trained so far; ``state``: the step's state.
    pending: the device values of a log row, written once the next call is queued.
    in_flight: the last call's loss (device), waited for before the call after it is queued.
  """

  def __init__(self, run: Run, config, workdir: str):
    self.built, self.config, self.workdir = run, config, workdir
    self.step = run.step
    self.lead = jax.process_index() == 0
    # microbatches one stage takes from the stream (a pipeline: M per data lane, not per device)
    self.rows_per_stage = self.step.microbatches_per_stage * config.batch.microbatch_size
    stream = batch_stream(
      run, config, run.tokens.train, self.rows_per_stage, seed=config.train.seed
    )
    if run.orders is not None:  # SkipPipe: each microbatch's layer order rides in its batch
      stream = run.orders.stream(stream, jax.process_index(), jax.process_count())
    self.stream = stream
    check_held_out(run, config)

  # -- set-up ---------------------------------------------------------------------------------------

  def begin(self, origin: start_lib.LoopStart, *, max_stages=None, launch=None) -> None:
    """Takes the restored or initialised state and opens what the loop writes to."""
    run, config = self.built, self.config
    self.state, self.stage, self.tokens_seen = origin.state, origin.stage, origin.tokens_seen
    self.start, self.max_stages = origin.stage, max_stages
    self.ckpt = origin.ckpt or start_lib.open_checkpointer(config, self.workdir)
    self.writer = metrics_lib.MetricWriter(self.workdir, enabled=self.lead)
    for name, fields in origin.events:
      self.writer.event(name, **fields)
    self.sent = float(origin.extra.get("wire_bytes", 0.0))  # bytes a worker sent to the others
    self.eval_fn = report.eval_function(run.model_cfg)  # the full model, also after SkipPipe
    self.instruction = isinstance(run.tokens, data.InstructData)  # prompts and responses
    self.comm_stage = self.step.comm_bytes_per_stage()
    self.flops_token = model.flops_per_token(run.model_cfg)
    self.peak = metrics_lib.peak_flops(jax.devices()[0])
    baseline = data.unigram_entropy(data.loss_tokens(run.tokens.train))
    self.summary: dict = {"unigram_baseline": baseline}
    self._print_header(baseline)
    self.budgets, self.policy = run.budgets, run.policy
    if self.budgets is not None:
      self.writer.event("budgets", stage=self.stage, budgets=self.budgets.tolist())
    self._watch(launch)
    self.preempt = monitor.Preemption()
    self.progress = metrics_lib.Progress(run.total_stages, self.stage, enabled=self.lead)
    self.clock = metrics_lib.StageClock()  # stage completions: the rates of rows and the summary
    window = profile.parse(config.train.profile_stages, run.total_stages)
    self.profiler = profile.StageProfiler(window, self.workdir)
    self.t_start = time.time()
    self.evaluated_at = None  # the stage of the last evaluation
    self.nonfinite = None  # device-side flag, read only at log and checkpoint time
    # The next batches are read and placed on the devices by a background thread while a call
    # runs; `consumed` is the data position after the last batch a call took (what a checkpoint
    # stores).
    self.consumed = self.stream.get_state()
    place = lambda b: parallel.global_batch(b, run.mesh, run.batch_axis, run.batch_whole)
    self.feed = data.Prefetcher(self.stream, place, depth=2)
    self.pending, self.in_flight = None, None
    self.outer = []  # (stage, a sync's device metrics), written with the next row

  def _print_header(self, baseline: float) -> None:
    run, config, step = self.built, self.config, self.step
    if not self.lead:
      return
    print(
      f"method={config.method} devices={run.mesh.size} params={step.num_params:,} "
      f"vocab={run.model_cfg.V} k/stage={step.num_microbatches} "
      f"B={config.batch.microbatch_size} L={config.data.seq_len} stages={run.total_stages} "
      f"unigram_baseline={baseline:.3f} nats",
      flush=True,
    )
    if self.instruction:
      print(report.describe_examples(run, config), flush=True)
    line = step.describe()  # the sync schedule, quantized sends, a pipeline's plan; or ''
    if line:
      print(line, flush=True)

  def _watch(self, launch) -> None:
    """Across processes: the watchdog of hangs, the verdict it leaves (health.json) and the
    streaks of slow workers that ``health.on_slow=exclude`` acts on."""
    config = self.config
    self.watchdog, self.recorder, self.slow = None, None, None
    if jax.process_count() == 1:
      return
    dog = monitor.Watchdog(
      config.health.hang_timeout_s or float("inf"),
      process_index=jax.process_index(),
      process_count=jax.process_count(),
    )
    self.recorder = dog.recorder = health.Recorder(self.workdir, dog, launch)
    if health.on_slow(config) == "exclude":
      self.slow = monitor.SlowStreak(config.health.slow_factor, config.health.slow_patience)
    if config.health.hang_timeout_s > 0:
      self.watchdog = dog.start()

  # -- the loop -------------------------------------------------------------------------------------

  def run(self, on_params=None) -> dict:
    """Calls the step until the last stage or a stop; returns the run's summary."""
    total = self.built.total_stages
    try:
      while self.stage < total:
        self.call()
        reason = self.preempt.requested or (
          "max_stages" if self.max_stages is not None and self.stage >= self.max_stages else None
        )
        if reason and self.stage < total:
          return self.stop(reason)
      self.finish(on_params)
    except Exception as e:
      if self.watchdog is not None and monitor.is_collective_failure(e):  # which peer is gone
        self.recorder.conclude(error=e)  # health.json, once the dead peer's heartbeat is stale
        e.add_note(f"process {jax.process_index()}: {self.recorder.message()}")
      raise
    finally:
      self.close()
    summary = report.in_order(self.summary)
    if self.lead:
      print(json.dumps({k: v for k, v in summary.items() if k != "sample"}), flush=True)
    return summary

  def call(self) -> None:
    """One call of the step and what follows it: a log row, an evaluation, a checkpoint."""
    config, step, total = self.config, self.step, self.built.total_stages
    stages = step.call_stages(self.stage, total)
    batches, positions = zip(*(next(self.feed) for _ in range(stages)), strict=True)
    self.probe(batches[0])
    sent = step.sent_bytes(self.stage, total)
    with self.profiler.stage(self.stage, stages):
      self.state, m = step.run(self.state, list(batches), self.stage, total, self.budgets)
    self.sent += sent
    outer = step.outer_metrics(m)
    if outer is not None:
      self.outer.append((self.stage + stages, outer))
    self.consumed = positions[-1]
    self._advance(m, batches[0]["inputs"].shape[-1], stages)
    done = updates_done(config, self.stage)
    prev = updates_done(config, self.stage - stages)
    crossed = lambda every: every and done // every != prev // every
    every = config.train.log_every
    if self.stage // every != (self.stage - stages) // every or self.stage == total:
      self.queue_row(m, done)
    if done != prev and crossed(config.train.eval_every):
      self.evaluate(done)
    if done != prev and crossed(config.ckpt.every):
      self.save()
    if self.watchdog is not None:
      self.watchdog.progress(self.stage)

  def _advance(self, m: dict, width: int, stages: int) -> None:
    """The bookkeeping after a call is queued: the call before it waited for (one call in
    flight, never more), its log row written, the counters and the non-finite flag moved on."""
    # One call in flight: the device stays busy while the host waits for the call before, a hang
    # shows within the watchdog's timeout, and XLA:CPU's dispatch queue stays short (with the
    # host many programs ahead, simulated devices deadlocked in a collective).
    if self.in_flight is not None:
      jax.block_until_ready(self.in_flight)
      self.clock.done(self.stage, self.tokens_seen)  # the call before this one has finished
      if self.watchdog is not None:
        self.watchdog.progress(self.stage)
    self.write_row()  # the previous logged call's, now that this one is queued behind it
    self.in_flight = m["loss"]
    used = self.step.microbatches_per_stage if self.budgets is None else int(self.budgets.sum())
    # width: data.seq_len, or an instruction batch's bucket
    self.tokens_seen += used * self.config.batch.microbatch_size * width * stages
    # elementwise, per worker under LoCo: a reduction here would be a collective across every
    # device after every call, which the next call's programs would queue behind. The first
    # call runs both of its programs (no flag yet, a flag): none compiles after it.
    finite = m.get("outer_finite", True)
    if self.nonfinite is None:
      self.nonfinite = _flag_nonfinite(None, m["loss"], finite)
    self.nonfinite = _flag_nonfinite(self.nonfinite, m["loss"], finite)
    self.stage += stages
    traced = self.profiler.finished(self.stage, m["loss"])
    if traced and self.lead:
      print(
        f"profile of stages {self.config.train.profile_stages}: {traced} (ui.perfetto.dev, or "
        f"python -m bench.gpu.profile_table {traced})",
        flush=True,
      )

  # -- the pieces ---------------------------------------------------------------------------------

  def probe(self, batch) -> None:
    """Times the devices apart from training when due (``health.probe_every``, adaptive budgets):
    the budgets follow, and slow workers are named, or excluded with a checkpoint and a restart."""
    config, stage, policy = self.config, self.stage, self.policy
    adapt = policy is not None and (stage == self.start or stage % config.hetero.adapt_every == 0)
    every = config.health.probe_every
    if not (adapt or (every and stage % every == 0)):
      return
    times = monitor.probe(
      self.step, self.state, batch, stage, config.health.slow_factor, self.writer
    )
    if self.recorder is not None:
      self.recorder.probed(stage, times)
      excluded = self.slow.observe(times[:, 0]) if self.slow is not None else []
      if excluded:
        self._restart_without(excluded)
    if policy is not None:
      per_device = [times[d.process_index, 0] for d in self.built.mesh.devices.flat]
      changed = policy.observe(per_device, float(times[:, 1].max()))
      self.budgets = policy.budgets
      self.writer.event("budgets", stage=stage, budgets=self.budgets.tolist(), changed=changed)

  def _restart_without(self, excluded) -> None:
    """Checkpoints here, then stops for a restart without the slow workers: no work is lost."""
    config, stage = self.config, self.stage
    self.write_row()
    if self.ckpt.latest_step() != stage:
      self.save()
    self.ckpt.wait()
    verdict = self.recorder.conclude(slow=excluded)
    self.writer.event(
      "excluded", stage=stage, verdict=verdict["verdict"], suspects=verdict["suspects"]
    )
    raise health.RestartWithout(
      f"stage {stage}: {self.recorder.message()} for {config.health.slow_patience} probes in a "
      f"row (health.on_slow=exclude); checkpoint saved at stage {stage}; restart with "
      "health.exclude=auto to resume without them"
    )

  def readable(self, tree):
    """``tree``, or under LoCo across processes (per-worker values) a copy on every device."""
    if all(x.is_fully_addressable or x.is_fully_replicated for x in jax.tree.leaves(tree)):
      return tree
    return self.step.replicated(tree)

  def queue_row(self, m: dict, update: int) -> None:
    """Keeps the device values of this call's log row (and of the syncs since the last row): they
    are read once the next call is queued (:meth:`write_row`)."""
    lr = optim.hyperparams(self.step.optimizer_state(self.state))
    lr = lr.get("learning_rate", float("nan"))
    self.pending = {
      "stage": self.stage,
      "update": update,
      "metrics": self.readable(m),
      "nonfinite": self.nonfinite,
      "lr": self.step.replicated(lr) if isinstance(lr, jax.Array) else lr,  # donated next
      "tokens_seen": self.tokens_seen,
      "budgets": None if self.budgets is None else self.budgets.tolist(),
      "sent": self.sent,
      "outer": [(at, self.readable(o)) for at, o in self.outer],
    }
    self.outer = []

  def write_row(self) -> None:
    """Writes the pending log row. Called once the next call is queued, it waits only for the
    call it reads, so the host never holds the device up at a log line."""
    p, self.pending = self.pending, None
    if p is None:
      return
    done_at = self.clock.wait(p["stage"], p["tokens_seen"], p["metrics"])
    m, lr, outer = jax.device_get((p["metrics"], p["lr"], p["outer"]))
    loss = float(np.mean(m["loss"]))  # LoCo: per-worker values; the mean over workers
    self.check_finite(p["nonfinite"], p["stage"])
    row = {
      "stage": p["stage"],
      "update": p["update"],
      "loss": loss,
      "grad_norm": float(np.mean(m["grad_norm"])),
      "lr": float(np.mean(lr)),
      "microbatches": float(np.sum(m["microbatches"])),
      "committed": bool(np.all(m["committed"])),
      "comm_bytes_per_device": self.comm_stage,
      "skipped_microbatches": float(np.sum(m["skipped"])),
      "tokens_seen": p["tokens_seen"],
      "wall_s": done_at - self.t_start,
    }
    rate = self.clock.row_rate(p["stage"])  # over the stages since the last row; none for a compile
    if rate is not None:
      row["tokens_per_s"] = rate
      if self.peak:
        row["mfu"] = rate * self.flops_token / (self.peak * self.built.mesh.size)
    if p["budgets"] is not None:  # every device's budget this stage
      row["budgets"] = p["budgets"]
    row.update(self.step.log_fields(m, p["sent"]))  # LoCo: per-worker losses, bytes sent
    for at, o in outer:  # the syncs since the last row
      self.writer.write(at, self.step.sync_row(o))
    self.writer.write(p["stage"], row)
    self.progress.update(p["stage"], f"loss {loss:.3f}", self.clock)
    self.summary["loss"] = loss

  def check_finite(self, flag, at_stage: int) -> None:
    if self.config.train.on_nonfinite != "stop" or flag is None:
      return
    flag = self.readable(flag)  # per-worker flags across processes: one copy everywhere
    if bool(np.any(np.asarray(flag))):
      raise FloatingPointError(
        f"non-finite loss before stage {at_stage}; the last good checkpoint is kept. Lower "
        "opt.lr, or set train.on_nonfinite=skip to drop non-finite microbatches"
      )

  def evaluate(self, update: int) -> None:
    """Held-out loss (and, for instruction data with ``train.exact_match=every``, answers)."""
    run, config = self.built, self.config
    self.write_row()
    params = self.step.params(self.state)
    ev = report.evaluate(run, config, params, self.eval_fn)
    if self.instruction and config.train.exact_match == "every":
      ev.update(report.answers(run, config, params, None, self.lead))
    self.writer.write(self.stage, {"update": update, **ev})
    self.summary.update(ev)
    self.evaluated_at = self.stage

  def save(self) -> None:
    """A checkpoint of this stage (the pending row written and the loss checked first)."""
    run, config, stage = self.built, self.config, self.stage
    self.write_row()
    self.check_finite(self.nonfinite, stage)
    extra = {
      "stage": stage,
      "data": self.consumed,
      "tokens_seen": self.tokens_seen,
      "vocab": vocab_meta(run.model_cfg),
      "wire_bytes": self.sent,
      "comm": comm_meta(config, self.step),
      **model_meta(run),
      "config": config.to_json_best_effort(),
      **self.step.checkpoint_extra(),
    }
    self.ckpt.save(stage, self.state, extra=extra)

  def throughput(self) -> None:
    """The run's tokens/s from the end of its first call to the end of its last, into the
    summary and ``metrics.jsonl``."""
    if self.in_flight is not None:  # the last call may not have been logged
      self.clock.wait(self.stage, self.tokens_seen, self.in_flight)
    rate = self.clock.run_rate()
    if rate is not None:
      self.writer.event("throughput", **rate)
      self.summary["tokens_per_s"] = rate["tokens_per_s"]

  def stop(self, reason: str) -> dict:
    """Stops before the last stage (preemption, ``max_stages``) with a checkpoint here."""
    stage = self.stage
    self.write_row()
    if self.ckpt.latest_step() != stage:
      self.save()
    self.ckpt.wait()
    self.throughput()
    self.writer.event("stopped", reason=reason, stage=stage)
    if self.lead:
      print(
        f"{reason}: checkpoint saved at stage {stage}; rerun the same command to resume",
        flush=True,
      )
    self.summary["stopped"] = stage
    return report.in_order(self.summary)

  def finish(self, on_params) -> None:
    """The end: the last row and syncs, the final evaluation, answers and sample, and the last
    checkpoint."""
    run, config, stage, step = self.built, self.config, self.stage, self.step
    self.write_row()
    self.throughput()
    for at, outer in jax.device_get([(at, self.readable(o)) for at, o in self.outer]):
      self.writer.write(at, step.sync_row(outer))
    self.summary.update(step.summary(self.sent))
    final = step.params(self.state)
    if on_params is not None:
      on_params(final)
    update = updates_done(config, stage)
    if self.evaluated_at != stage:  # the last update may have been evaluated already
      ev = report.evaluate(run, config, final, self.eval_fn)
      self.writer.write(stage, {"update": update, **ev})
      self.summary.update(ev)
    if self.instruction and config.train.exact_match != "off":  # greedy replies, held-out prompts
      answered = report.answers(run, config, final, self.workdir, self.lead)
      self.writer.write(stage, {"update": update, **answered})
      self.summary.update(answered)
    self.summary.update(stages=stage, updates=update)
    if self.ckpt.latest_step() != stage:
      self.save()
    if config.train.sample_tokens and self.lead:
      self.summary["sample"] = report.sample(run, config, final, self.workdir)

  def close(self) -> None:
    self.profiler.stop()
    self.feed.close()
    self.progress.close()
    self.preempt.restore()
    self.ckpt.wait()
    self.ckpt.close()
    self.writer.close()
    if self.watchdog is not None:
      self.watchdog.stop()
