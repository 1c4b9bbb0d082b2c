"""The training loop: data, model, method, checkpoints and metrics, driven by a config.

``train_and_evaluate(config, workdir)`` is what ``train.py`` calls: it builds the run
(:func:`acco_jax.run.build.build`), restores or initialises its state (:mod:`acco_jax.run.start`)
and drives a :class:`Loop`. Reading order of the loop: :meth:`Loop.drive` is the loop itself; each
pass is one call of the family's step (:meth:`Loop.call`), after which it may log a row
(:meth:`Loop.queue_row`; :class:`acco_jax.run.rows.Rows` writes it once the next call is queued),
evaluate (:meth:`Loop.evaluate`), save (:meth:`Loop.save`) and stop (:meth:`Loop.stop`); a probe
(:meth:`Loop.probe`) may come before a call, and :meth:`Loop.finish` ends the run. The loop holds
the run's position (state, stage, data) and three parts: the rows being written
(:class:`acco_jax.run.rows.Rows`), the clock and progress (:class:`acco_jax.run.metrics.Pace`)
and the health watch (:class:`acco_jax.run.monitor.Watch`).

Units: a *stage* is one program call of ``k`` microbatches per device; an *update* is one
optimizer step (ACCO: a commit, every second stage; the others: every stage). Schedules, evaluation
and checkpoint periods count updates; the checkpoint step number counts stages. A family's step
(:class:`acco_jax.step_api.Step`) runs one or more stages a call (a LoCo window or phase runs
several inner steps in one program).
"""

from __future__ import annotations

import json
import os

import jax

from acco_jax import data, errors, optim, parallel, step_api
from acco_jax.ckpt import meta
from acco_jax.family_api import Run
from acco_jax.run import build as build_lib
from acco_jax.run import compile_cache, health, monitor, profile, report, streams
from acco_jax.run import memory as memory_lib
from acco_jax.run import metrics as metrics_lib
from acco_jax.run import start as start_lib
from acco_jax.run.rows import Rows


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
  check = lambda c: build_lib.build(c, check_only=True)
  memory_lib.fit_devices(config, check, lead=lead)  # mesh.fit_memory
  run = build_lib.build(config)
  stream, rows_per_stage = streams.train_stream(run, config)
  streams.check_held_out(run, config)
  memory_lib.check_run(run, config, lead=lead)  # the predicted peak; refused if it cannot fit
  # -- restore or initialise (acco_jax.run.start); nothing written to the workdir before ---------
  origin = start_lib.restore_or_init(
    run, config, workdir, stream, rows_per_stage, init_params, lead
  )
  if origin.stage >= run.total_stages:  # nothing left: report the finished run, train nothing
    if origin.ckpt is not None:
      origin.ckpt.close()
    if on_params is not None:  # a kill may have come between the last checkpoint and this call
      on_params(run.step.params(origin.state))
    sent = float(origin.extra.get("wire_bytes", 0.0))
    return report.finished(run, config, workdir, origin.stage, sent, lead)
  loop = Loop(run, config, workdir, stream, origin, max_stages=max_stages, launch=launch)
  return loop.drive(on_params)


class Loop:
  """One run of the stage loop over a built :class:`acco_jax.family_api.Run`, from the state it
  starts from (:class:`acco_jax.run.start.LoopStart`; see the module docstring for its reading
  order).

  Attributes:
    built, config, workdir: the run, its config and its directory.
    state: the step's state; ``stage``: stages done.
    feed: the next batches, read and placed by a background thread while a call runs, each with
      the data position after it; ``consumed``: the position after the last batch a call took
      (what a checkpoint stores).
    ckpt: the run's checkpoints.
    eval_fn: the held-out loss of the full model (also after SkipPipe's paths).
    rows, pace, watch: the rows being written, the clock and progress, the health watch.
  """

  def __init__(
    self, run: Run, config, workdir: str, stream, origin, *, max_stages=None, launch=None
  ):
    self.built, self.config, self.workdir = run, config, workdir
    self.state, self.stage = origin.state, origin.stage
    self.consumed = stream.get_state()
    place = lambda b: parallel.global_batch(b, run.mesh, run.batch_axis, run.batch_whole)
    self.feed = data.Prefetcher(stream, place, depth=2)
    self.ckpt = origin.ckpt or start_lib.open_checkpointer(config, workdir)
    self.eval_fn = report.eval_function(run.model_cfg)
    window = profile.parse(config.train.profile_stages, run.total_stages)
    self.pace = metrics_lib.Pace(
      run.total_stages, origin.stage, profile_window=window, workdir=workdir, max_stages=max_stages
    )
    self.watch = monitor.Watch(config, workdir, launch)
    run.step.watch_stop(lambda: self.watch.preempt.requested is not None)  # a wait gives up
    self.watch.preempt.begin(self.stage)  # across processes, SIGTERM stops all at one stage
    self.rows = Rows(run, workdir, origin, self.pace, self.watch)
    baseline = data.unigram_entropy(data.loss_tokens(run.tokens.train))
    self.rows.summary["unigram_baseline"] = baseline
    self._print_header(baseline)
    if run.step.budgets is not None:  # heterogeneous workers' fixed budgets
      self.rows.writer.event("budgets", stage=self.stage, budgets=run.step.budgets.tolist())

  @property
  def step(self):
    return self.built.step

  @property
  def instruction(self) -> bool:
    """Instruction data (prompts and responses): exact-match answers are scored."""
    return isinstance(self.built.tokens, data.InstructData)

  def _print_header(self, baseline: float) -> None:
    run, config, step = self.built, self.config, self.step
    if not self.pace.lead:
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

  # -- the loop -------------------------------------------------------------------------------------

  def drive(self, on_params=None) -> dict:
    """Calls the step until the last stage or a stop; returns the run's summary."""
    total, stop_at = self.built.total_stages, self.pace.stop_at
    try:
      while self.stage < total:
        self.call()
        reason = self.watch.preempt.at_boundary(self.stage) or (
          "max_stages" if stop_at is not None and self.stage >= stop_at else None
        )
        if reason and self.stage < total:
          return self.stop(reason)
      self.finish(on_params)
    except Exception as e:
      self.watch.failed(e)  # which peer is gone, when a collective failed
      raise
    finally:
      self.close()
    summary = report.in_order(self.rows.summary)
    if self.pace.lead:
      print(json.dumps({k: v for k, v in summary.items() if k != "sample"}), flush=True)
    return summary

  def call(self) -> None:
    """One call of the step and what follows it: a log row, an evaluation, a checkpoint."""
    config, step, total = self.config, self.step, self.built.total_stages
    stages = step.call_stages(self.stage, total)
    batches, positions = zip(*(next(self.feed) for _ in range(stages)), strict=True)
    self.probe(batches[0])
    sent = step.sent_bytes(self.stage, total)
    with self.pace.profiler.stage(self.stage, stages):
      self.state, m = step.call(self.state, list(batches), self.stage, total)
    self.rows.sent += sent
    outer = step.outer_metrics(m)
    if outer is not None:
      self.rows.outer.append((self.stage + stages, outer))
    self.consumed = positions[-1]
    self._advance(m, batches[0]["inputs"].shape[-1], stages)
    done = self.built.updates_done(self.stage)
    prev = self.built.updates_done(self.stage - stages)
    crossed = lambda every: every and done // every != prev // every
    every = config.train.log_every
    if self.stage // every != (self.stage - stages) // every or self.stage == total:
      self.queue_row(m, done)
    if done != prev and crossed(config.train.eval_every):
      self.evaluate(done)
    if done != prev and crossed(config.ckpt.every):
      self.save()
    self.watch.progress(self.stage)

  def _advance(self, m: dict, width: int, stages: int) -> None:
    """The bookkeeping after a call is queued: the call before it waited for (one call in
    flight, never more), its log row written, the counters and the non-finite flag moved on."""
    # One call in flight: the device stays busy while the host waits for the call before, a hang
    # shows within the watchdog's timeout, and XLA:CPU's dispatch queue stays short (with the
    # host many programs ahead, simulated devices deadlocked in a collective).
    if self.pace.queued(self.stage, self.rows.tokens_seen, m["loss"]):
      self.watch.progress(self.stage)
    self.rows.write()  # the previous logged call's, now that this one is queued behind it
    budgets = self.step.budgets
    used = self.step.microbatches_per_stage if budgets is None else int(budgets.sum())
    # width: data.seq_len, or an instruction batch's bucket
    self.rows.tokens_seen += used * self.config.batch.microbatch_size * width * stages
    self.watch.flag(m["loss"], m.get(step_api.OUTER_FINITE, True))
    self.stage += stages
    traced = self.pace.profiler.finished(self.stage, m["loss"])
    if traced and self.pace.lead:
      print(
        f"profile of stages {self.config.train.profile_stages}: {traced} (ui.perfetto.dev, or "
        f"python -m bench.gpu.profile_table {traced})",
        flush=True,
      )

  # -- the pieces ---------------------------------------------------------------------------------

  def probe(self, batch) -> None:
    """Times the devices apart from training when due (``health.probe_every``, adaptive budgets):
    the budgets follow, and slow workers are named, or excluded with a checkpoint and a restart."""
    config, stage, step, watch = self.config, self.stage, self.step, self.watch
    if not isinstance(step, step_api.Probed):  # build refuses probes and budgets for the others
      return
    every = config.health.probe_every
    if not (step.adapts(stage, self.pace.start) or (every and stage % every == 0)):
      return
    writer = self.rows.writer
    times = monitor.probe(step, self.state, batch, stage, config.health.slow_factor, writer)
    if watch.recorder is not None:
      watch.recorder.probed(stage, times)
      excluded = watch.slow.observe(times[:, 0]) if watch.slow is not None else []
      if excluded:
        self._restart_without(excluded)
    per_device = [times[d.process_index, 0] for d in self.built.mesh.devices.flat]
    changed = step.adapt(per_device, float(times[:, 1].max()))
    if changed is not None:
      writer.event("budgets", stage=stage, budgets=step.budgets.tolist(), changed=changed)

  def _restart_without(self, excluded) -> None:
    """Checkpoints here, then stops for a restart without the slow workers: no work is lost."""
    config, stage, recorder = self.config, self.stage, self.watch.recorder
    self.rows.write()
    if self.ckpt.latest_step() != stage:
      self.save()
    self.ckpt.wait()
    verdict = recorder.conclude(slow=excluded)
    self.rows.writer.event(
      "excluded", stage=stage, verdict=verdict["verdict"], suspects=verdict["suspects"]
    )
    raise health.RestartWithout(
      f"stage {stage}: {recorder.message()} for {config.health.slow_patience} probes in a "
      f"row (health.on_slow=exclude); checkpoint saved at stage {stage}; restart with "
      "health.exclude=auto to resume without them"
    )

  def queue_row(self, m: dict, update: int) -> None:
    """Keeps this call's log row, read once the next call is queued (:class:`Rows`)."""
    lr = optim.hyperparams(self.step.optimizer_state(self.state))
    lr = lr.get("learning_rate", float("nan"))
    self.rows.queue(self.stage, update, m, lr, self.step.budgets)

  def evaluate(self, update: int) -> None:
    """Held-out loss (and, for instruction data with ``train.exact_match=every``, answers)."""
    run, config = self.built, self.config
    self.rows.write()
    params = self.step.params(self.state)
    ev = report.evaluate(run, config, params, self.eval_fn)
    if self.instruction and config.train.exact_match == "every":
      ev.update(report.answers(run, config, params, None, self.pace.lead))
    self.rows.writer.write(self.stage, {"update": update, **ev})
    self.rows.summary.update(ev)
    self.rows.evaluated_at = self.stage

  def save(self) -> None:
    """A checkpoint of this stage (the pending row written and the loss checked first)."""
    run, config, stage = self.built, self.config, self.stage
    self.rows.write()
    self.watch.check_finite(self.watch.nonfinite, stage, self.step)
    extra = meta.written(
      run,
      config,
      self.step,
      stage=stage,
      data=self.consumed,
      tokens_seen=self.rows.tokens_seen,
      wire_bytes=self.rows.sent,
    )
    self.ckpt.save(stage, self.state, extra=extra)

  def stop(self, reason: str) -> dict:
    """Stops before the last stage (preemption, ``max_stages``) with a checkpoint here."""
    stage = self.stage
    self.rows.write()
    if self.ckpt.latest_step() != stage:
      self.save()
    self.ckpt.wait()
    self.rows.throughput(stage)
    self.rows.writer.event("stopped", reason=reason, stage=stage)
    if self.pace.lead:
      print(
        f"{reason}: checkpoint saved at stage {stage}; rerun the same command to resume",
        flush=True,
      )
    self.rows.summary["stopped"] = stage
    return report.in_order(self.rows.summary)

  def finish(self, on_params) -> None:
    """The end: the last row and syncs, the final evaluation, answers and sample, and the last
    checkpoint."""
    run, config, stage, rows = self.built, self.config, self.stage, self.rows
    rows.write()
    rows.throughput(stage)
    rows.write_syncs()
    rows.summary.update(self.step.summary(rows.sent))
    final = self.step.params(self.state)
    if on_params is not None:
      on_params(final)
    update = run.updates_done(stage)
    if rows.evaluated_at != stage:  # the last update may have been evaluated already
      ev = report.evaluate(run, config, final, self.eval_fn)
      rows.writer.write(stage, {"update": update, **ev})
      rows.summary.update(ev)
    if self.instruction and config.train.exact_match != "off":  # greedy replies, held-out prompts
      answered = report.answers(run, config, final, self.workdir, self.pace.lead)
      rows.writer.write(stage, {"update": update, **answered})
      rows.summary.update(answered)
    rows.summary.update(stages=stage, updates=update)
    if self.ckpt.latest_step() != stage:
      self.save()
    if config.train.sample_tokens and self.pace.lead:
      rows.summary["sample"] = report.sample(run, config, final, self.workdir)

  def close(self) -> None:
    self.pace.close()
    self.feed.close()
    self.watch.close()
    self.ckpt.wait()
    self.ckpt.close()
    self.rows.writer.close()
