"""Whether the policy ``auto`` switched to keeps training stable: the workers' training loss,
watched, pure.

The ranking predicts progress from throughput and a model of statistical efficiency
(``efficiency``), fitted over a range of runs; it cannot know the learning rate at which a
policy stops converging.  The parameter server applies every worker's update in full (the
Downpour-style update of ASP, SSP and DSSP: n workers move the model by the *sum* of their
steps where the ring moves it by their mean), so a learning rate tuned for the ring acts
about n times larger there, and at the edge of stability a run that was converging faster
can diverge in under a second (at equal speeds, lr 0.05 with momentum 0.9, 4 workers: the
evaluation loss went from 1.6 to 2.3, chance level, twice in two runs, ``bench/auto``), or
swing for many seconds without settling (one such run: the evaluation loss between 0.44 and
1.43 for 15 s, the accuracy between 0.58 and 0.85, where the ring reached 0.9 within 1.2 s of
the switch back).  ``undone`` is 0.3: a swing that gives back a third of the run's progress,
over a whole second and on two checks, is that instability, not minibatch noise (a 1 s mean
of 4 workers' reports moves by a few percent); at 0.5 the swinging run above was left only
after 26 s on the PS.

:class:`LossWatch` measures instead of predicting: the workers report their training loss (each
a mean over its last iterations), and a policy *undoes its progress* when the mean loss over the
last ``window_s`` (widened to the last ``min_reports`` reports where a job that steps slowly
sent fewer: ``LossWatch.level``) rises back above the lowest level of its phase by more than
``undone`` of the way to the run's initial loss (and by ``rise`` relative at least), on
``confirm`` consecutive checks; a non-finite loss is that at once.  Where the phase is still
below the level it started from (it made progress of its own and gave part of it back), the rise
must also last ``persist_s``: a parameter server with a straggler overshoots and comes back
(fixed ASP on a CNN at lr 0.01 with momentum 0.9: the evaluation loss from 0.68-0.92 up to
1.19-1.88 for 2-3 s, each run reaching the target 3-8 s later), and a watch that left it on two
checks cost those runs 10 s.  That allowance is made once per phase: a phase that swings up again
is swinging, not overshooting (SSP at equal speeds, lr 0.05 with momentum 0.9: the evaluation
loss between 0.5 and 2.0 for 25 s in one run, each swing shorter than 3 s), and is left on two
checks; so is a phase back above its start, which undid more than it made.  (A rise seen on a
single check uses the allowance up too: in that run the first swing showed on one check, the
second on two.  The rule is read off these runs: 8 ASP runs at lr 0.01-0.1 rose on one stretch of
checks each at most, 4 SSP runs at equal speeds on 1-4. Also leaving a rise below the start on
two checks once it gave back 0.8 of the progress was tried, and dropped: an ASP run at lr 0.1
overshot by 0.83 and was taken back, 24.3 s to the target against 13.1-20.6 for the three
others.)  Measured against the run's own progress (initial minus lowest), the test is scale-free
and robust to the noise of minibatch losses, which is large against the loss itself late in a
run and small against the progress made. Before the run has made ``min_progress`` of its initial
loss there is no progress to undo, and nothing fires.  The serving side (``serving.AutoPolicy``)
switches back to the policy it left and does not choose the diverging one (or, on the PS, any
full-update candidate) again until a worker's speed or the number of workers changes.  Nothing is
predicted, nothing is raced: the figures come from the training the job does anyway, at one
64-byte message per worker every 0.1 s (``mpsync.torch.strategies.switching``). """

from __future__ import annotations

import math
from collections import deque

__all__ = ["LossWatch"]


class LossWatch:
    """The workers' training-loss reports, and whether the running phase undoes progress.

    ``add(now, loss, count)``: a report (the mean of ``count`` iterations' losses; ``inf``
    for a non-finite one).  ``begin(now, label)``: a new policy runs from ``now``.
    ``check(now)``: why the running phase is diverging, or None.
    """

    # The levels the checks saw, kept for the run's metrics (``series``): one every
    # ``SERIES_EVERY_S`` at most, the last ``SERIES_MAX`` of them (20 minutes).
    SERIES_EVERY_S = 0.5
    SERIES_MAX = 2400

    def __init__(self, *, window_s: float = 1.0, min_reports: int = 6, undone: float = 0.3,
                 rise: float = 0.2, min_progress: float = 0.1, confirm: int = 2,
                 persist_s: float = 3.0, max_window_s: float = 5.0):
        if not (window_s > 0 and min_reports >= 1 and 0 < undone and rise >= 0
                and 0 <= min_progress < 1 and confirm >= 1 and persist_s >= 0
                and max_window_s >= window_s):
            raise ValueError("LossWatch: window_s > 0, min_reports >= 1, undone > 0, "
                             "rise >= 0, 0 <= min_progress < 1, confirm >= 1, persist_s >= 0, "
                             "max_window_s >= window_s")
        self.max_window_s = float(max_window_s)
        self.persist_s = float(persist_s)
        self._rising_since: float | None = None
        self._overshot = False       # this phase already had its one allowed overshoot
        self.window_s, self.min_reports = float(window_s), int(min_reports)
        self.undone, self.rise = float(undone), float(rise)
        self.min_progress, self.confirm = float(min_progress), int(confirm)
        self.reports = deque()        # (time, loss, count) within the last max_window_s
        self.total_reports = 0
        self.initial: float | None = None      # the first full window's mean loss
        self._first: list = []                 # the reports that make it
        self.lowest: float | None = None       # the run's lowest window mean
        self.phase_label: str | None = None
        self.phase_start_level: float | None = None
        self.phase_lowest: float | None = None
        self.last_level: float | None = None
        self._seen = 0
        self.non_finite = 0
        self._series = deque(maxlen=self.SERIES_MAX)  # (time, level, phase's reference)
        self._series_next = -math.inf
        self._first_time: float | None = None

    # -- input ---------------------------------------------------------------------------------
    def add(self, now: float, loss: float, count: int = 1) -> None:
        loss, count = float(loss), max(int(count), 1)
        self.total_reports += 1
        if self._first_time is None:
            self._first_time = now
        if not math.isfinite(loss):
            self.non_finite += 1
            loss = math.inf
        self.reports.append((now, loss, count))
        if self.initial is None:
            self._first.append((now, loss, count))
            if len(self._first) >= self.min_reports and now - self._first[0][0] >= self.window_s:
                self.initial = _mean(self._first)
                self._first = []

    def begin(self, now: float, label: str) -> None:
        """A switch took effect at ``now``: the phase of ``label`` starts at the level of the
        window before it."""
        self.phase_label = label
        level = self.level(now)
        self.phase_start_level = level if level is not None else self.last_level
        self.phase_lowest, self._seen, self._rising_since = None, 0, None
        self._overshot = False

    # -- the test ------------------------------------------------------------------------------
    def level(self, now: float) -> float | None:
        """The mean loss over the last ``window_s``, widened back to the last ``min_reports``
        reports where fewer arrived in it, as far as ``max_window_s`` (None: fewer than that).

        A worker reports once a step at most, so a job whose n workers step less often than
        ``min_reports / window_s`` times a second in all never filled the window: at 0.35 s
        steps a 4x straggler held SSP's fast workers at its pace, about 3 reports a second
        came, and the watch saw no level from the straggler's arrival to the next switch,
        4 s in which it would have left a phase that had given back 95% of its progress
        (bench/auto/README.md, *A slow job's loss watch*)."""
        while self.reports and self.reports[0][0] < now - self.max_window_s:
            self.reports.popleft()
        recent, since = [], now - self.window_s
        for report in reversed(self.reports):
            if report[0] < since and len(recent) >= self.min_reports:
                break
            recent.append(report)
        if len(recent) < self.min_reports:
            return None
        return _mean(recent)

    def check(self, now: float) -> str | None:
        """Why the phase that began last undoes the run's progress, or None."""
        level = self.level(now)
        if level is None:
            return None
        if now >= self._series_next:
            self._series_next = now + self.SERIES_EVERY_S
            reference = None
            if self.phase_label is not None and math.isfinite(level):  # (the test's, below)
                low = level if self.phase_lowest is None else self.phase_lowest
                reference = min(low, self.phase_start_level or level)
            self._series.append((now, level, reference))
        self.last_level = level
        if math.isfinite(level):
            self.lowest = level if self.lowest is None else min(self.lowest, level)
        if self.phase_label is None:
            return None
        if not math.isfinite(level):
            return (f"the training loss is not finite under {self.phase_label} "
                    f"({self.non_finite} report(s))")
        if self.phase_lowest is None:
            self.phase_lowest = level
        reference = min(self.phase_lowest, self.phase_start_level or level)
        self.phase_lowest = min(self.phase_lowest, level)
        if self.initial is None or not self.initial > 0:
            return None
        progress = self.initial - reference
        rose = level - reference
        if not (progress > self.min_progress * self.initial and rose > self.undone * progress
                and level > (1.0 + self.rise) * reference):
            if self._seen:
                self._overshot = True      # (it came back: even one check above used it up)
            self._seen, self._rising_since = 0, None
            return None
        self._seen += 1
        if self._rising_since is None:
            self._rising_since = now
        if self._seen < self.confirm:
            return None
        start = self.phase_start_level
        lasted = now - self._rising_since
        if (start is not None and level < start and lasted < self.persist_s
                and not self._overshot):
            return None      # still below where the phase began: an overshoot must last
        how = (f"on {self._seen} checks" if start is None or level >= start else
               f"on {self._seen} checks, the phase's second rise" if self._overshot else
               f"for {lasted:.1f} s, below the {start:.3f} it began at")
        return (f"the training loss rose from {reference:.3f} to {level:.3f} under "
                f"{self.phase_label}, undoing {rose / progress:.0%} of the progress from "
                f"{self.initial:.3f} (more than {self.undone:.0%}, {how})")

    def risen(self, now: float) -> bool:
        """The last window's mean is above its phase's lowest by more than ``rise`` (or not
        finite): weights from before the rise are the better ones to go on from."""
        level = self.level(now)
        if level is None or self.phase_lowest is None:
            return False
        return not math.isfinite(level) or level > (1.0 + self.rise) * self.phase_lowest

    def series(self) -> list:
        """``[seconds since the first report, window mean, the phase's reference]`` per check
        kept (the reference: None before a phase has one), to read a run's watch after it."""
        t0 = self._first_time or 0.0

        def r(x):
            return None if x is None or not math.isfinite(x) else round(x, 4)
        return [[round(t - t0, 2), r(level), r(ref)] for t, level, ref in self._series]

    def describe(self) -> dict:
        def r(x):
            return None if x is None or not math.isfinite(x) else round(x, 4)
        return {"reports": self.total_reports, "initial": r(self.initial),
                "lowest": r(self.lowest), "last": r(self.last_level),
                "non_finite": self.non_finite, "phase": self.phase_label}


def _mean(reports) -> float:
    total = sum(c for _, _, c in reports)
    return sum(loss * c for _, loss, c in reports) / total
