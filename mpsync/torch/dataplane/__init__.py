"""The data plane: how a worker's tensors move, whatever the policy decided about when.

The aggregators behind one interface (``backends``: mpi4py and Horovod on the ring;
``process_group``: gloo and NCCL through a ``torch.distributed`` group of the workers), the
flat buffers that fuse many parameters into one collective (``fusion``), what travels on the
wire (``compression``), the bounded waits on a collective in flight (``waiting``) and the
exception types a script catches when one fails (``exceptions``).  Nothing here knows a
policy: the strategies (:mod:`mpsync.torch.strategies`) call down into it, and the Horovod
face (:mod:`mpsync.torch`) sits on top of both.
"""
