"""The training loop: data, model, method, checkpoints and metrics, driven by a config.

``train_and_evaluate(config, workdir)`` is what ``train.py`` calls. Reading order: set-up (mesh,
data, model, optimizer, step), restore or initialise, the stage loop (log, evaluate, checkpoint),
the end (final evaluation, sample, last checkpoint).

Units: a *stage* is one call of the step (``k`` microbatches per device); an *update* is one
optimizer step (ACCO: a commit, every second stage; the others: every stage). Schedules, evaluation
and checkpoint periods count updates; the checkpoint step number counts stages.
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
  lead = jax.process_index() == 0
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise errors.UserValueError(
      f"workdir {workdir!r} is a file: pass --workdir a directory (new or a run's)"
    )
  compile_cache.configure(config.compile.cache_dir)
  run = build(config)
  window = profile.parse(config.train.profile_stages, run.total_stages)
  train, mesh, n = run.train, run.mesh, run.mesh.size
  # microbatches one stage takes from the stream (a pipeline: M per data lane, not per device)
  mb_per_stage = getattr(train, "microbatches_per_stage", n * train.num_microbatches)
  rows_per_stage = mb_per_stage * config.batch.microbatch_size
  stream = batch_stream(run, config, run.tokens.train, rows_per_stage, seed=config.train.seed)
  if run.orders is not None:  # SkipPipe: each microbatch's layer order rides in its batch
    stream = run.orders.stream(stream, jax.process_index(), jax.process_count())

  # -- restore or initialise (acco_jax.run.start); nothing written to the workdir before ---------
  begun = start_lib.restore_or_init(run, config, workdir, stream, rows_per_stage, init_params, lead)
  state, start, tokens_seen, extra, events, ckpt = begun
  if start >= run.total_stages:  # nothing left: report the finished run, train nothing
    ckpt.close()
    if on_params is not None:  # a kill may have come between the last checkpoint and this call
      on_params(train.params(state))
    return report.finished(run, config, workdir, start, float(extra.get("wire_bytes", 0.0)), lead)
  ckpt = ckpt or start_lib.open_checkpointer(config, workdir)
  writer = metrics_lib.MetricWriter(workdir, enabled=lead)
  for name, fields in events:
    writer.event(name, **fields)

  eval_fn = report.eval_function(run.model_cfg)  # the full model, also after SkipPipe training
  baseline = data.unigram_entropy(data.loss_tokens(run.tokens.train))
  instruction = isinstance(run.tokens, data.InstructData)  # prompts and responses
  n_params = train.layout.num_params
  flops_token = model.flops_per_token(run.model_cfg)
  peak = metrics_lib.peak_flops(jax.devices()[0])
  plan = train.inner.plan if run.loco else train.plan
  comm_stage = metrics_lib.comm_bytes_per_stage(plan, train.layout.padded_size, train.num_devices)
  comm_stage *= getattr(train, "stages_per_step", 1)  # LoCo's ACCO inner step: two stages
  if lead:
    print(
      f"method={config.method} devices={n} params={n_params:,} vocab={run.model_cfg.V} "
      f"k/stage={train.num_microbatches} B={config.batch.microbatch_size} L={config.data.seq_len} "
      f"stages={run.total_stages} unigram_baseline={baseline:.3f} nats",
      flush=True,
    )
    if instruction:
      print(report.describe_examples(run, config), flush=True)
    line = train.describe()  # the sync schedule, quantized sends, a pipeline's plan; or ''
    if line:
      print(line, flush=True)

  budgets, policy = run.budgets, run.policy
  if budgets is not None:
    writer.event("budgets", stage=start, budgets=budgets.tolist())
  rows_per_microbatch = config.batch.microbatch_size

  # -- the loop -----------------------------------------------------------------------------------
  watchdog, in_flight, recorder, slow = None, None, None, None
  if jax.process_count() > 1:  # the verdict (health.json) and the policy for slow workers
    dog = monitor.Watchdog(
      config.health.hang_timeout_s or float("inf"), process_index=jax.process_index(),
      process_count=jax.process_count(),
    )  # fmt: skip
    recorder = dog.recorder = health.Recorder(workdir, dog, launch)
    if health.on_slow(config) == "exclude":
      slow = monitor.SlowStreak(config.health.slow_factor, config.health.slow_patience)
    if config.health.hang_timeout_s > 0:
      watchdog = dog.start()
  preempt = monitor.Preemption()
  progress = metrics_lib.Progress(run.total_stages, start, enabled=lead)
  clock = metrics_lib.StageClock()  # stage completions: the rates of the rows and the summary
  profiler = profile.StageProfiler(window, workdir)
  t_start = time.time()
  summary: dict = {"unigram_baseline": baseline}
  stage = start
  evaluated_at = None  # the stage of the last evaluation

  nonfinite = None  # device-side flag, read only at log and checkpoint time
  # The next batches are read and placed on the devices by a background thread while a stage runs;
  # `consumed` is the data position after the last batch a stage took (what a checkpoint stores).
  consumed = stream.get_state()
  place = lambda b: parallel.global_batch(b, mesh, run.batch_axis, run.batch_whole)
  feed = data.Prefetcher(stream, place, depth=2)
  pending = None  # a logged stage's device metrics, read after the next stage is dispatched

  def readable(tree):
    """``tree``, or under LoCo across processes (per-worker values) a copy on every device."""
    if all(x.is_fully_addressable or x.is_fully_replicated for x in jax.tree.leaves(tree)):
      return tree
    return train.replicated(tree)

  def check_finite(flag, at_stage):
    if config.train.on_nonfinite != "stop" or flag is None:
      return
    flag = readable(flag)  # per-worker flags across processes: one copy everywhere
    if bool(np.any(np.asarray(flag))):
      raise FloatingPointError(
        f"non-finite loss before stage {at_stage}; the last good checkpoint is kept. Lower "
        "opt.lr, or set train.on_nonfinite=skip to drop non-finite microbatches"
      )

  def flush():
    """Writes the pending log row. Called once the next stage is queued, it waits only for the
    stage it reads, so the host never holds the device up at a log line."""
    nonlocal pending
    if pending is None:
      return
    p, pending = pending, None
    done_at = clock.wait(p["stage"], p["tokens_seen"], p["metrics"])
    m, lr, outer = jax.device_get((p["metrics"], p["lr"], p["outer"]))
    loss = float(np.mean(m["loss"]))  # LoCo: per-worker values; the mean over workers
    check_finite(p["nonfinite"], p["stage"])
    row = {
      "stage": p["stage"], "update": p["update"], "loss": loss,
      "grad_norm": float(np.mean(m["grad_norm"])), "lr": float(np.mean(lr)),
      "microbatches": float(np.sum(m["microbatches"])), "committed": bool(np.all(m["committed"])),
      "comm_bytes_per_device": comm_stage, "skipped_microbatches": float(np.sum(m["skipped"])),
      "tokens_seen": p["tokens_seen"], "wall_s": done_at - t_start,
    }  # fmt: skip
    rate = clock.row_rate(p["stage"])  # over the stages since the last row; none for a compile
    if rate is not None:
      row["tokens_per_s"] = rate
      if peak:
        row["mfu"] = rate * flops_token / (peak * n)
    if p["budgets"] is not None:  # every device's budget this stage
      row["budgets"] = p["budgets"]
    if run.loco:  # per-worker losses, bytes sent so far, and the outer steps since the last line
      row.update(worker_loss=np.asarray(m["loss"]).tolist(), wire_bytes_per_worker=p["wire_bytes"])
      for at, o in outer:
        writer.write(at, train.outer_row(o))
    writer.write(p["stage"], row)
    progress.update(p["stage"], f"loss {loss:.3f}", clock)
    summary["loss"] = loss

  def throughput():
    """The run's tokens/s from the end of its first stage to the end of its last, into the
    summary and ``metrics.jsonl``."""
    if in_flight is not None:  # the last stage may not have been logged
      clock.wait(stage, tokens_seen, in_flight)
    rate = clock.run_rate()
    if rate is not None:
      writer.event("throughput", **rate)
      summary["tokens_per_s"] = rate["tokens_per_s"]

  def save(stage):
    flush()
    check_finite(nonfinite, stage)
    ckpt.save(stage, state, extra={"stage": stage, "data": consumed, "tokens_seen": tokens_seen,
                                   "vocab": vocab_meta(run.model_cfg), "wire_bytes": wire_bytes,
                                   "comm": comm_meta(config, train), **model_meta(run),
                                   "config": config.to_json_best_effort(),
                                   **getattr(train, "checkpoint_extra", dict)()})  # fmt: skip

  wire_bytes = float(extra.get("wire_bytes", 0.0))  # LoCo: bytes sent per worker so far
  outer_rows = []  # LoCo: (stage, outer metrics on device), written at the next log line

  try:
    while stage < run.total_stages:
      call = train.plan(stage, run.total_stages) if run.loco else None
      batches, positions = zip(
        *(next(feed) for _ in range(call.stages if call else 1)), strict=True
      )
      batch, consumed_next = batches[0], positions[-1]
      adapt = policy is not None and (stage == start or stage % config.hetero.adapt_every == 0)
      if adapt or (config.health.probe_every and stage % config.health.probe_every == 0):
        times = monitor.probe(train, state, batch, stage, config.health.slow_factor, writer)
        if recorder is not None:
          recorder.probed(stage, times)
          excluded = slow.observe(times[:, 0]) if slow is not None else []
          if excluded:  # checkpoint here, then restart without them: no work is lost
            flush()
            if ckpt.latest_step() != stage:
              save(stage)
            ckpt.wait()
            verdict = recorder.conclude(slow=excluded)
            writer.event("excluded", stage=stage, verdict=verdict["verdict"],
                         suspects=verdict["suspects"])  # fmt: skip
            raise health.RestartWithout(
              f"stage {stage}: {recorder.message()} for {config.health.slow_patience} probes "
              f"in a row (health.on_slow=exclude); checkpoint saved at stage {stage}; restart "
              "with health.exclude=auto to resume without them"
            )
        if policy is not None:
          per_device = [times[d.process_index, 0] for d in mesh.devices.flat]
          changed = policy.observe(per_device, float(times[:, 1].max()))
          budgets = policy.budgets
          writer.event("budgets", stage=stage, budgets=budgets.tolist(), changed=changed)
      if run.loco:
        with profiler.stage(stage, call.stages):
          state, m = train.run(state, list(batches), stage, run.total_stages)
        sent = call.sync if call.sync is not None else call.send
        for p in (
          call.phase,
          sent,
        ):  # an overlapped phase sends one fragment, its last sync another
          if p is not None:
            wire_bytes += train.wire_bytes(p)
        if "outer_fragment" in m:
          outer_rows.append((stage + call.stages, m))
      else:
        with profiler.stage(stage, 1):
          state, m = train.step(state, batch, budgets)
      consumed = consumed_next
      # One stage in flight, never more: the device stays busy while the host waits for the stage
      # before, a hang shows within the watchdog's timeout, and XLA:CPU's dispatch queue stays
      # short (with the host many programs ahead, simulated devices deadlocked in a collective).
      if in_flight is not None:
        jax.block_until_ready(in_flight)
        clock.done(stage, tokens_seen)  # the stage before this one has finished: now
        if watchdog is not None:
          watchdog.progress(stage)
      flush()  # the previous logged stage, now that this one is queued behind it
      in_flight = m["loss"]
      stages_run = len(batches)
      used = mb_per_stage if budgets is None else int(budgets.sum())
      width = batch["inputs"].shape[-1]  # data.seq_len, or an instruction batch's bucket
      tokens_seen += used * rows_per_microbatch * width * stages_run
      # elementwise, per worker under LoCo: a reduction here would be a collective across every
      # device after every stage, which the next stage's programs would queue behind. The first
      # stage runs both of its programs (no flag yet, a flag): none compiles after it.
      finite = m.get("outer_finite", True)
      if nonfinite is None:
        nonfinite = _flag_nonfinite(None, m["loss"], finite)
      nonfinite = _flag_nonfinite(nonfinite, m["loss"], finite)
      stage += stages_run
      traced = profiler.finished(stage, m["loss"])
      if traced and lead:
        print(f"profile of stages {config.train.profile_stages}: {traced} (ui.perfetto.dev, or "
              f"python bench/gpu/profile_table.py {traced})", flush=True)  # fmt: skip
      done = updates_done(config, stage)
      prev = updates_done(config, stage - stages_run)
      at_update = done != prev
      crossed = lambda every: every and done // every != prev // every  # noqa: B023
      logged = stage // config.train.log_every != (stage - stages_run) // config.train.log_every
      if logged or stage == run.total_stages:
        opt_state = state.inner.opt_state if run.loco else state.opt_state
        lr = optim.hyperparams(opt_state).get("learning_rate", float("nan"))
        m, outer = readable(m), [(at, readable(o)) for at, o in outer_rows]
        pending = {
          "stage": stage, "update": done, "metrics": m, "nonfinite": nonfinite,
          "lr": train.replicated(lr) if isinstance(lr, jax.Array) else lr,  # donated next
          "tokens_seen": tokens_seen, "budgets": None if budgets is None else budgets.tolist(),
          "wire_bytes": wire_bytes, "outer": outer,
        }  # fmt: skip
        outer_rows.clear()
      if at_update and crossed(config.train.eval_every):
        flush()
        ev = report.evaluate(run, config, train.params(state), eval_fn)
        if instruction and config.train.exact_match == "every":
          ev.update(report.answers(run, config, train.params(state), None, lead))
        writer.write(stage, {"update": done, **ev})
        summary.update(ev)
        evaluated_at = stage
      if at_update and crossed(config.ckpt.every):
        save(stage)
      if watchdog is not None:
        watchdog.progress(stage)
      stop = preempt.requested or (
        "max_stages" if max_stages is not None and stage >= max_stages else None
      )
      if stop and stage < run.total_stages:
        flush()
        if ckpt.latest_step() != stage:
          save(stage)
        ckpt.wait()
        throughput()
        writer.event("stopped", reason=stop, stage=stage)
        if lead:
          print(f"{stop}: checkpoint saved at stage {stage}; rerun the same command to resume",
                flush=True)  # fmt: skip
        summary["stopped"] = stage
        return report.in_order(summary)
    # -- the end ----------------------------------------------------------------------------------
    flush()
    throughput()
    if run.loco:
      for at, outer in jax.device_get([(at, readable(o)) for at, o in outer_rows]):
        writer.write(at, train.outer_row(outer))
      summary.update(report.loco_summary(train, wire_bytes))
    final = train.params(state)
    if on_params is not None:
      on_params(final)
    if evaluated_at != stage:  # the last update may have been evaluated already
      ev = report.evaluate(run, config, final, eval_fn)
      writer.write(stage, {"update": updates_done(config, stage), **ev})
      summary.update(ev)
    if instruction and config.train.exact_match != "off":  # greedy replies to held-out prompts
      answered = report.answers(run, config, final, workdir, lead)
      writer.write(stage, {"update": updates_done(config, stage), **answered})
      summary.update(answered)
    summary.update(stages=stage, updates=updates_done(config, stage))
    if ckpt.latest_step() != stage:
      save(stage)
    if config.train.sample_tokens and lead:
      summary["sample"] = report.sample(run, config, final, workdir)
  except Exception as e:
    if watchdog is not None and monitor.is_collective_failure(e):  # say which peer is gone
      recorder.conclude(error=e)  # health.json, after the dead peer's heartbeat has gone stale
      e.add_note(f"process {jax.process_index()}: {recorder.message()}")
    raise
  finally:
    profiler.stop()
    feed.close()
    progress.close()
    preempt.restore()
    ckpt.wait()
    ckpt.close()
    writer.close()
    if watchdog is not None:
      watchdog.stop()
  summary = report.in_order(summary)
  if lead:
    print(json.dumps({k: v for k, v in summary.items() if k != "sample"}), flush=True)
  return summary
