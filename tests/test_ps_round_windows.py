"""BSP with the server-side optimizer (``ps_optimizer='server'``): the windows in which the
shards of one parameter server could hold different rounds, in one process, each shard a
``ServerUpdates`` of its own fed the orders that the state server does not rule out.  Every
pull names the round its grant reads and the workers whose pushes that round leaves out
(``StateServer._round_told``), and every shard steps on exactly those pushes at the round's
first pull there.

* A worker whose iteration is idle (it waits in a collective of the script's own) pushes
  nothing and is counted: its pull reads the round on every shard, whichever pull reaches a
  shard first.
* After a join a round's step divides by the n workers whoever pushed, as Horovod's join
  (zeros from a joined rank, an average over the size) and as the workers' own optimizer
  (each delta scaled by 1/n), so both optimizer modes train the same model.
* A worker taken out for silence whose next push comes while the others' pulls of a round
  are on their way to the shards: it stays out of that round on every shard.

The state server's side (which round a grant names, fixed at its first grant) is checked
end to end in tests/test_ps_server_optimizer.py."""

import numpy as np

from mpsync.server.shard_optimizer import OptimizerSettings, ServerUpdates

ADAM = OptimizerSettings(kind="adam", lr=0.1)


def _shard(n: int, settings=ADAM) -> ServerUpdates:
    shard = ServerUpdates(per_round=True, scale=1.0 / n)
    assert shard.configure(settings.to_array()) is None
    return shard


def test_an_idle_worker_s_pull_reads_its_round_on_every_shard():
    # Two shards of one model (two elements each); workers 0 and 1.  Round 1: both push.
    g = {0: np.array([1.0, 2.0]), 1: np.array([3.0, -1.0])}
    shards = [_shard(2), _shard(2)]
    weights = [np.ones(2), np.ones(2)]
    for s, w in zip(shards, weights):
        assert s.take(w, g[0], 0) is None and s.take(w, g[1], 1) is None
        assert s.settle(w, 1) == 1 and s.settle(w, 1) == 0
    # Round 2: worker 0 pushes a gradient; worker 1 waits in the script's collective and its
    # idle iteration pushes nothing (counted by the state server).  Worker 0's pull reaches
    # shard 0 first; worker 1's reaches shard 1 first.
    for s, w in zip(shards, weights):
        assert s.take(w, g[0], 0) is None
        assert s.take(w, np.empty(0), 1) is None
    shards[0].settle(weights[0], 2)
    read_0 = weights[0].copy()                 # worker 1's read of shard 0: after worker 0's
    shards[0].settle(weights[0], 2)
    assert np.array_equal(weights[0], read_0)
    shards[1].settle(weights[1], 2)
    read_1 = weights[1].copy()                 # worker 1's read of shard 1: it came first
    shards[1].settle(weights[1], 2)
    # Both shards hold the same numbers (same gradients, same rounds): worker 1 read round 2
    # on both, not round 2 on one and round 1 on the other.
    assert np.array_equal(read_0, read_1), (read_0, read_1)
    assert shards[0].optimizer.steps == shards[1].optimizer.steps == 2


def test_an_idle_push_is_sent_to_every_shard_and_a_last_push_to_none():
    from mpsync.server._client_ps import ParameterServerCalls

    class Shards:
        def __init__(self):
            self.pushed = []

        def push(self, delta, finite=False):
            self.pushed.append(delta.size)

    class Client(ParameterServerCalls):
        def __init__(self):
            self.shards, self.calls = Shards(), []
            self._rep = np.zeros(8)

        def _header(self, *a, **kw):
            return kw

        def _call(self, tag, what, header=None):
            self.calls.append((what, header["flag"]))

    client = Client()
    client.push(np.ones(4), 1)
    client.push(np.ones(4)[:0], 2)              # an idle iteration: no gradient since
    client.push(np.ones(4)[:0], 3, final=True)  # join's last push: nothing left
    assert client.shards.pushed == [4, 0]
    assert client.calls == [("push 1", 0), ("push 2", 0), ("push 3", 1)]


def test_a_round_after_a_join_divides_by_every_worker_in_both_optimizer_modes():
    # Three workers; worker 2 joined after round 1.  Plain SGD: the workers' own optimizer
    # pushes -lr*g, applied scaled by 1/3 (PolicySpec.ps_update_scale); the server's must
    # step on the same sum / 3.
    lr, n = 0.5, 3
    g = [np.array([1.0, 2.0]), np.array([3.0, -1.0]), np.array([0.5, 0.5])]
    shard = _shard(n, OptimizerSettings(kind="sgd", lr=lr))
    w = np.zeros(2)
    for k in range(n):
        shard.take(w, g[k], k)
    shard.settle(w, None)
    for k in range(2):                          # round 2: workers 0 and 1 only
        shard.take(w, g[k], k)
    shard.settle(w, None)
    worker_mode = np.zeros(2) - lr * (g[0] + g[1] + g[2]) / n - lr * (g[0] + g[1]) / n
    np.testing.assert_allclose(w, worker_mode, rtol=0, atol=1e-15)


def test_without_a_scale_a_round_steps_on_the_mean_of_its_pushes():
    shard = ServerUpdates(per_round=True)
    shard.configure(OptimizerSettings(kind="sgd", lr=1.0).to_array())
    w = np.zeros(1)
    shard.take(w, np.array([2.0]), 0), shard.take(w, np.array([4.0]), 1)
    shard.settle(w, None)
    np.testing.assert_array_equal(w, [-3.0])


def test_a_late_push_of_a_worker_taken_out_lands_in_one_round_on_every_shard():
    # Three workers, two shards.  Round 1: all three push and pull.  Round 2: workers 0 and 1
    # push; worker 2 is silent, taken out, and the state server grants their pulls of round
    # 2 leaving worker 2 out.  Worker 0's pull reaches shard 0 (which steps on round 2)
    # before worker 2 pushes again, and shard 1 after it.
    g = {w: np.full(2, float(w + 1)) for w in range(3)}
    shards = [_shard(3), _shard(3)]
    weights = [np.ones(2), np.ones(2)]
    for s, w in zip(shards, weights):
        for k in range(3):
            s.take(w, g[k], k)
        s.settle(w, 1)
        s.take(w, g[0], 0), s.take(w, g[1], 1)
    shards[0].settle(weights[0], 2, (2,))          # worker 0's pull, on shard 0 only
    for s, w in zip(shards, weights):
        s.take(w, g[2], 2)                          # worker 2's late push, on both
    shards[1].settle(weights[1], 2, (2,))          # worker 0's pull reaches shard 1
    assert np.array_equal(weights[0], weights[1]), weights
    for s, w in zip(shards, weights):
        s.settle(w, 2)                              # worker 2's own pull of round 2 (back)
        s.take(w, g[0], 0), s.take(w, g[1], 1), s.take(w, g[2], 2)     # round 3
        assert s.settle(w, 3) == 1
    # Every shard put worker 2's late push into round 3, beside its push of round 3.
    assert np.array_equal(weights[0], weights[1]), weights
    expected = _adam(3, [g[0] + g[1] + g[2], g[0] + g[1], g[0] + g[1] + 2 * g[2]])
    np.testing.assert_array_equal(weights[0], expected)


def _adam(n: int, sums) -> np.ndarray:
    """Single-process Adam (``ADAM``) from ones on each round's summed gradient over n."""
    from mpsync.server.shard_optimizer import ShardOptimizer

    opt, w = ShardOptimizer(ADAM, 2), np.ones(2)
    for total in sums:
        opt.step(w, total / n)
    return w


def test_the_state_server_fixes_whom_a_round_leaves_out_at_its_first_grant():
    from mpi4py import MPI

    from mpsync.config import SyncConfig
    from mpsync.server import StateServer

    def server(policy):
        config = SyncConfig.from_options(env={}, policy=policy, topology="ps",
                                         server="colocated", ps_optimizer="server",
                                         silent_timeout=600.0, deadline=600.0)
        # Three workers' tables; only _round_told is called (no message is sent).
        return StateServer(MPI.COMM_SELF.Dup(), config, workers=[0, 1, 2], fast_path=False)

    bsp = server("bsp")
    assert bsp.rounds_told and not server("ssp").rounds_told
    pushes = bsp.table.pushes
    pushes[:] = (1, 1, 1)
    assert bsp._round_told(0)[0] == 1 and bsp._round_told(0)[1].size == 0
    pushes[:] = (2, 2, 1)                        # worker 2 taken out: round 2 granted without it
    round_, left_out = bsp._round_told(0)
    assert round_ == 2 and left_out.tolist() == [2]
    pushes[2] = 2                                # its late push, counted after that grant
    for w in (1, 2):                             # every pull of round 2 leaves it out
        assert bsp._round_told(w)[1].tolist() == [2]
    pushes[:] = (3, 3, 3)
    assert bsp._round_told(2) == (3, bsp._left_out[3]) and bsp._left_out[3].size == 0
    pushes[:] = (0, 0, 0)                        # a first pull names no round
    assert bsp._round_told(0)[0] == 0
