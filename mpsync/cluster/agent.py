"""The virtual cluster's ``ssh``: runs a command on a node, for Open MPI and horovodrun.

``mpsync cluster up`` writes this file, followed by the cluster's node table, as an executable
script (``agent`` in the cluster's state folder, and ``bin/ssh`` linking to it).  Open MPI's rsh
launcher (``--mca plm_rsh_agent``) and horovodrun call it as they call ssh::

    agent [ssh options] HOST [COMMAND...]

It runs COMMAND through ``sh -c`` in the node's network namespace (``nsenter --net``: unlike
``ip netns exec`` it leaves the mount namespace, /sys and the cgroup mounts alone) with the
node's hostname (``unshare --uts``), keeping the caller's environment and working directory, as
a shared home directory and a login shell do on a real cluster.

Like an ssh session it stays the parent of the remote command, and like ssh with
``ServerAliveInterval`` it checks that the node still answers over the cluster network: every
``ALIVE_INTERVAL`` seconds it opens a TCP connection to the node's address (an answer, even a
refusal, means the node is reachable).  When nothing has answered for ``ALIVE_TIMEOUT``
seconds (the node's link is cut) it ends the remote command, closes this host's connections to
the node (see ``drop_connections``) and exits 255, as ssh does; mpirun then counts that node's
daemon as lost and ends the job instead of waiting for it for the quarter of an hour TCP takes.
``ALIVE_TIMEOUT`` is longer than the state server's heartbeat suspicion (3 s by default,
mpsync.server.heartbeat), so mpsync names the silent ranks before Open MPI reports the lost
node, and short enough that a cut link ends a job within seconds of that: mpirun, which waits
for every node's daemon after an abort, waits for this session to end.  (A real ssh gets the
same from ``-o ServerAliveInterval=1 -o ServerAliveCountMax=6``.)

Standard library only: it runs before (and outside) any virtual environment.
"""

import os
import signal
import socket
import subprocess
import sys
import time

ALIVE_INTERVAL = 1.0
ALIVE_TIMEOUT = 6.0
PROBE_PORT = 9  # discard: nothing listens there, so a reachable node answers with a refusal
SSH_OPTIONS_WITH_VALUE = set("BbcDEeFIiJLlmOoPpQRSWw")


def split_ssh_args(argv):
    """(host, remote command words) from an ssh command line.  As OpenSSH does, options are
    read before and after the host, up to the first word of the command (horovodrun puts
    ``-p``/``-o ConnectTimeout=...`` after the host)."""
    host, i = None, 0
    while i < len(argv):
        word = argv[i]
        if word.startswith("-") and word != "-":
            i += 2 if len(word) == 2 and word[1] in SSH_OPTIONS_WITH_VALUE else 1
        elif host is None:
            host, i = word, i + 1
        else:
            break
    return host, argv[i:]


def remote_argv(node, command):
    """The local command that runs ``command`` (ssh's words, joined for the remote shell) on
    ``node`` (a dict with ``namespace`` and ``name``)."""
    script = " ".join(command) if command else "exec sh"
    return ["nsenter", f"--net=/run/netns/{node['namespace']}", "unshare", "--uts", "sh", "-c",
            f"hostname {node['name']} && {script}"]


def reachable(address, timeout):
    try:
        socket.create_connection((address, PROBE_PORT), timeout=timeout).close()
        return True
    except ConnectionRefusedError:
        return True
    except OSError:  # timed out, no route, host unreachable
        return False


def descendants(pid):
    """Every process below ``pid`` (read from /proc; the tree may change meanwhile)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pids, pgid, sig):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def end_session(child, grace=3.0):
    """SIGTERM the remote command's whole tree (its process group and every descendant, also
    those orphaned on the way), then SIGKILL whatever is left after ``grace`` seconds."""
    tree = {child.pid, *descendants(child.pid)}
    _signal(tree, child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        tree.update(descendants(child.pid))
        if child.poll() is not None and not any(_alive(p) for p in tree):
            return
        time.sleep(0.05)
    tree.update(descendants(child.pid))
    _signal(tree, child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + grace  # SIGKILL takes effect when the victim next runs
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.02)


def drop_connections(address):
    """Close this host's TCP connections to ``address``.

    Across a cut link nothing acknowledges what this host sends, and TCP keeps retransmitting
    for about 15 minutes (``tcp_retries2``) before it reports the peer gone; mpirun waits that
    long for the lost node's daemon to confirm its ranks are dead.  The session has been ended
    on the node (the ranks there are gone), so this host gives up on the node's connections
    now: mpirun sees its daemon's connection close and finishes the job.
    """
    subprocess.run(["ss", "-K", "dst", address], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def main(argv, nodes, cluster):
    """``nodes``: host (address or name) -> {"name", "namespace", "address"}."""
    host, command = split_ssh_args(argv)
    if host is None:
        print(f"usage: {sys.argv[0]} [ssh options] HOST [COMMAND...]", file=sys.stderr)
        return 255
    node = nodes.get(host)
    if node is None:
        names = " ".join(sorted({n["name"] for n in nodes.values()}))
        print(f"mpsync cluster {cluster}: no node {host} (nodes: {names})", file=sys.stderr)
        return 255
    child = subprocess.Popen(remote_argv(node, command), start_new_session=True)

    def stop(signum, _frame):
        end_session(child)
        sys.exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    last_answer = time.monotonic()
    while True:
        try:
            code = child.wait(timeout=ALIVE_INTERVAL)
            return 128 - code if code < 0 else code  # killed by a signal: as a shell says it
        except subprocess.TimeoutExpired:
            pass
        if reachable(node["address"], ALIVE_INTERVAL):
            last_answer = time.monotonic()
        elif time.monotonic() - last_answer > ALIVE_TIMEOUT:
            print(f"mpsync cluster {cluster}: {node['name']} ({node['address']}) has not "
                  f"answered for {ALIVE_TIMEOUT:g} s (its link is cut or down): ending the "
                  f"session there, as ssh does when its server stops answering",
                  file=sys.stderr, flush=True)
            end_session(child)
            drop_connections(node["address"])
            return 255
