"""When the workers of ``mpsync train`` stop: the budget (``--time-budget``), the epochs asked
for (``--epochs``) or, with ``--stop-at-target``, the first evaluation at or above
``--target-acc``, whichever comes first; every worker stops on the same decision.

Time-to-accuracy benchmarks end a run once it reaches its quality target (MLPerf Training's
rule: "time to train" is measured to the first evaluation that meets the target), since the
time after it says nothing about the question asked and only makes the comparison longer.
Only worker 0 evaluates, so it alone knows when the target is reached; how the others hear it
depends on the topology (the ``mpsync.apps.train`` module doc says why each decides where it
does):

* :class:`RingStop`: at round boundaries, where every worker is present, one small allreduce
  of (samples, time-is-up, worker 0 reached the target); with ``--stop-at-target`` at every
  round, so the run ends at the first round after the evaluation that reached it.
* :class:`PsCheckpointStop`: at checkpoint rounds (every K pushes of each worker), worker 0
  decides for all, the target being one more reason.
* :class:`AutoStop`: ``auto`` with the PS's shards (``auto_ps``) runs :class:`RingStop`'s
  rule while it runs the ring and :class:`PsStop`'s while it runs the PS, where each worker
  counts its own rounds (a collective at round boundaries would pair different rounds, and a
  worker waiting in it could straddle the switch back to the ring, where BSP's workers never
  take part in each other's collectives).  Checkpoints (``--checkpoint-every``) are written in
  the ring's phases only.
* :class:`PsStop`: no common rounds; worker 0 decides the budget for every worker, on its
  clock (the budget excludes evaluations, which only worker 0 makes), and tells the others
  with a non-blocking broadcast (:class:`StopSignal`) that they test after every step; every
  worker also stops when the server's count of samples reaches the epochs asked for, and
  worker 0 at its target (``--stop-at-target``).  Each worker on its own clock would stop
  the others up to worker 0's evaluation time early (their clocks count the waits its
  evaluations cause under SSP and DSSP), leaving worker 0 to train alone, its gap to the
  stopped workers growing past the staleness bound.

Each rule's ``reason`` is, once it returned True, why the run stopped: ``"target"``,
``"budget"`` or ``"epochs"`` (written to the metrics by worker 0).
"""

from __future__ import annotations

from mpsync import policies
from mpsync.apps.train_checkpoints import ps_checkpoint, write_checkpoint

__all__ = ["make_stop", "RingStop", "AutoStop", "PsCheckpointStop", "PsStop", "StopSignal",
           "REASONS", "samples_share", "samples_between_checks"]

REASONS = ("target", "budget", "epochs")


def make_stop(w):
    """The stop rule of worker ``w``'s run (a collective over the workers with
    ``--stop-at-target`` on the PS without checkpoints: call it on every worker)."""
    if w.config.topology == "ring":
        return AutoStop(w) if policies.hosts_shards(w.config) else RingStop(w)
    return PsCheckpointStop(w) if w.args.checkpoint_every else PsStop(w)


def samples_share(before: tuple[int, int], now: tuple[int, int], share: float) -> float:
    """The workers' samples per sample of this worker's between two agreed sums, each given as
    ``(agreed sum, this worker's samples)``; ``share`` (the last one measured) where either did
    not grow.  Under BSP it is the number of workers; under ElasticBSP with stragglers
    1,1,2,4 worker 0 takes 4 of a superstep's 11 steps, and its share is 2.75, not 4."""
    grown_sum, grown_own = now[0] - before[0], now[1] - before[1]
    if grown_sum <= 0 or grown_own <= 0:
        return share
    return grown_sum / grown_own


def samples_between_checks(agreed_at: tuple[int, int], own: int, share: float) -> int:
    """The workers' samples estimated between the ring's stop checks: the last agreed sum,
    plus this worker's samples since it times its share (:func:`samples_share`).  This
    worker's samples times the workers would overstate the sum by as much as the workers
    differ in speed (by about 45% with stragglers 1,1,2,4), and the axis, which never goes
    back, would then stand still until the sums caught up."""
    agreed, own_then = agreed_at
    return agreed + int(round(max(0, own - own_then) * share))


def _time_or_epochs(w) -> str:
    return "budget" if w.time_up() else "epochs"


class RingStop:
    """Ring: the workers agree at round boundaries (every worker is there), with one small
    allreduce of (samples, time-is-up, target reached); checkpoints every K rounds."""

    def __init__(self, w):
        self.w = w
        self.reason: str | None = None
        # A strategy that aggregates every step checks every 5 rounds, not every step; with
        # --stop-at-target every round, so that the run ends right after its target.
        self.check_every = (5 if w.opt.strategy.aggregates_every_step
                            and not w.args.stop_at_target else 1)
        self.last_checked = w.opt.strategy.round
        # The last agreed sum with this worker's samples then, and its share of the sums.
        self.agreed_at = (w.agreed_samples, w.samples)
        self.share = float(w.n)

    def after_step(self, round_before: int, *, check: bool = False) -> bool:
        """Whether the run stops after this step; ``check``: agree on the sum at this round
        whether or not one is due (every worker must pass it, as at any check), and write no
        checkpoint (``auto``'s move to the PS, whose rounds write none)."""
        import torch

        w, rnd = self.w, self.w.opt.strategy.round
        done = False
        if rnd != self.last_checked and (check or w.round % self.check_every == 0):
            self.last_checked = rnd
            agreed = w.mps.allreduce(torch.tensor([w.samples, int(w.time_up()),
                                                   int(w.reached_target)], dtype=torch.int64),
                                     average=False, name="stop check")
            w.global_samples = w.agreed_samples = int(agreed[0])
            now = (w.agreed_samples, w.samples)
            self.share = samples_share(self.agreed_at, now, self.share)
            self.agreed_at = now
            epochs = w.target_samples is not None and w.global_samples >= w.target_samples
            done = bool(agreed[1] > 0 or agreed[2] > 0) or epochs
            if done:
                self.reason = ("target" if agreed[2] > 0 else
                               "budget" if agreed[1] > 0 else "epochs")
        else:
            w.global_samples = max(w.global_samples, samples_between_checks(
                self.agreed_at, w.samples, self.share))
        # Every K rounds, whether or not this round also checks for the stop: every worker
        # completes the same rounds, so all of them get here.
        k = w.args.checkpoint_every
        if k and rnd != round_before and w.round % k == 0 and not done and not check:
            gathered = w.mps.gather_object(w.state(), root_rank=0, name="checkpoint state")
            if w.me == 0:
                write_checkpoint(w.out, w.model, gathered, w.n, w.wall(), w.evals, w.round,
                                 w.steps, w.config)
        return done

    def close(self) -> None:
        """Nothing outstanding: every decision was a completed collective."""


class AutoStop:
    """``auto`` over both topologies: the ring's rule in its ring phases, the PS's in its PS
    phases (module doc).  Every worker switches topology after the same step, so all of them
    apply the same rule to each step."""

    def __init__(self, w):
        self.w = w
        self.reason: str | None = None
        self.ring, self.ps = RingStop(w), PsStop(w)
        self.on_ps = False

    def after_step(self, round_before: int) -> bool:
        w = self.w
        on_ps = w.opt.strategy.topology == "ps"
        moved = on_ps and not self.on_ps
        self.on_ps = on_ps
        if moved and w.opt.strategy.round != round_before:
            # The step that moved to the PS closed the ring's last round (every worker
            # switches after it): the workers agree on the samples there, the ring's rule once
            # more.  Without it the PS's count went on from the round before, and the axis
            # (which never goes back) stood still for a round's samples, 1.2 s in a CNN job.
            done = self.ring.after_step(round_before, check=True)
            w.ps_samples_base = w.agreed_samples
            switches = getattr(w.opt.strategy, "switches", None)
            if switches:   # (the metrics' record of the move: the samples taken before it)
                switches[-1]["samples"] = w.agreed_samples
            self.reason = self.ring.reason if done else None
            return done
        if moved:
            # The PS's model starts counting its updates at 0 at each move from the ring:
            # they are samples beyond the ring's last sum, which every worker agreed on.
            w.ps_samples_base = w.agreed_samples
        rule = self.ps if on_ps else self.ring
        done = rule.after_step(round_before)
        self.reason = rule.reason if done else None
        return done

    def close(self) -> None:
        self.ps.close()


class PsCheckpointStop:
    """PS with checkpoints: the stop is decided only at checkpoint rounds, where every worker
    takes part in the checkpoint's collectives; worker 0 decides (its target is one more
    reason to stop)."""

    def __init__(self, w):
        self.w = w
        self.reason: str | None = None

    def after_step(self, round_before: int) -> bool:
        w = self.w
        if w.opt.strategy.round == round_before or w.round % w.args.checkpoint_every != 0:
            w.global_samples = max(w.global_samples, ps_samples(w))
            return False
        reached = w.reached_target
        done, w.global_samples = ps_checkpoint(w.mps, w.opt, w.out, w.model, w.me, w.n,
                                               w.state(), w.time_up() or reached,
                                               w.target_samples, w.wall, w.evals, w.round,
                                               w.steps, w.config)
        if done:
            self.reason = "target" if reached else _time_or_epochs(w)
        return done

    def close(self) -> None:
        """Nothing outstanding: every decision was a completed collective."""


class PsStop:
    """PS without checkpoints: no common rounds; worker 0 stops on its clock (budget, target)
    and its :class:`StopSignal` stops the others; any worker stops when the server's count of
    samples reaches the epochs asked for (module doc)."""

    def __init__(self, w):
        self.w = w
        self.reason: str | None = None
        self.signal = StopSignal(w.mps.worker_comm())

    def after_step(self, round_before: int) -> bool:
        w = self.w
        if w.me != 0 and self.signal.heard():
            self.reason = self.signal.reason
            return True
        self.reason = self._own_reason()
        if self.reason is not None and w.me == 0:
            # Before the last push: the others stop now, after the step they are in.
            self.signal.send(self.reason)
        return self.reason is not None

    def _own_reason(self) -> str | None:
        w = self.w
        if w.reached_target:
            return "target"
        if w.me == 0 and w.time_up():
            return "budget"
        if w.target_samples is not None and w.step_count % 10 == 0:
            server = w.mps.stats()["server"] or {}
            counted = sum(s.get("iterations", 0) for s in server.get("workers", {}).values())
            w.global_samples = max(w.global_samples, counted * w.args.batch_size)
            if w.config.policy == policies.AUTO:
                # Counts only: an estimate between the ring's checks can run ahead of the
                # samples taken (a worker's samples times the workers stopped runs at 2.5 of
                # 3 epochs).  The ring's last agreed sum, or the server's.
                known = max(w.agreed_samples,
                            w.samples_at_start + counted * w.args.batch_size)
                return "epochs" if known >= w.target_samples else None
            return "epochs" if w.global_samples >= w.target_samples else None
        w.global_samples = max(w.global_samples, ps_samples(w))
        return None

    def close(self) -> None:
        """After the last push (``strategy.finish``): every worker waits for worker 0's
        broadcast (posted when it stopped, whatever the reason), so none is left pending."""
        self.signal.close()


def ps_samples(w) -> int:
    """The samples in the model worker ``w`` pulled last: the updates the server had applied
    (the pull's version), a batch each, over those before a resume.  Not this worker's
    samples times the workers, which overstates them by as much as the workers differ in
    speed, so that the final count (each worker's own, summed) came out below the evaluation
    before it.  ``auto`` starts the server's count again at each move from the ring: there the
    count goes on from the ring's last agreed sum (:class:`AutoStop`)."""
    base = w.ps_samples_base if w.config.policy == policies.AUTO else w.samples_at_start
    return base + int(w.opt.strategy.version) * w.args.batch_size


class StopSignal:
    """Worker 0 tells the other workers, once, that it has stopped: a non-blocking broadcast
    on a communicator of its own (a ``Dup`` of the workers'), which the others post at the
    start and test after each step, and worker 0 posts when it stops.

    MPI lets the ranks of a non-blocking collective start it at different times; the
    broadcast completes on a receiver once worker 0 has posted it, so a receiver's test costs
    one ``MPI_Test`` and never waits."""

    def __init__(self, workers):
        import numpy as np

        self.comm = workers.Dup()   # collective: every worker makes its stop rule together
        self.root = self.comm.Get_rank() == 0
        self.flag = np.zeros(1, dtype=np.int64)
        self.request = None if self.root else self.comm.Ibcast(self.flag, root=0)

    def heard(self) -> bool:
        """(not worker 0) Has worker 0 stopped?"""
        return bool(self.request.Test())

    @property
    def reason(self) -> str:
        """Why worker 0 stopped (once heard): one of :data:`REASONS`."""
        return REASONS[int(self.flag[0]) - 1]

    def send(self, reason: str) -> None:
        """(worker 0) I have stopped, for ``reason``."""
        if self.request is None:
            self.flag[0] = REASONS.index(reason) + 1
            self.request = self.comm.Ibcast(self.flag, root=0)

    def close(self) -> None:
        """Complete the broadcast on every worker (worker 0 sends it here if it has not)."""
        if self.root:
            self.send("budget")
        self.request.Wait()
        self.comm.Free()
