"""How the gloo / NCCL process group's workers find worker 0 across nodes
(``mpsync.torch.dataplane.process_group``): by address, not by a host name that may resolve
nowhere.  The whole rendezvous across real namespaces is tests/test_cluster.py's gloo case.
"""

from __future__ import annotations

import socket

from mpsync.torch.dataplane.process_group import host_addresses, reach


def test_host_addresses_are_this_nodes_own_and_leave_loopback_out():
    found = host_addresses()
    assert found, "a machine with a network has at least one non-loopback IPv4 address"
    assert len(found) == len(set(found)), found
    for address in found:
        assert not address.startswith("127."), found
        socket.inet_aton(address)   # a dotted IPv4 address, not a name
        # each is an address of this node: a socket binds to it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((address, 0))


def test_reach_skips_what_does_not_answer_and_names_this_ends_address():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(4)
        port = listening.getsockname()[1]
        # the socket listens on 127.0.0.1 only: 127.0.0.2 refuses the connection
        got = reach(["127.0.0.2", "127.0.0.1"], port, timeout=0.3)
        assert got == ("127.0.0.1", "127.0.0.1"), got
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        free_port = closed.getsockname()[1]
    assert reach(["127.0.0.1"], free_port, timeout=0.3) is None
