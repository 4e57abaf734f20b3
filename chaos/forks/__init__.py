"""Start Python commands by forking one process that imported torch once (opt-in, Linux).

Every launch of a test or a chaos run starts Python processes, and each fresh interpreter pays
about 3 s of CPU for `import torch` and 2 more for the checkpoint and compiler modules that a
training rank loads: far more than a short test run spends training. With the fork server on
(`procs.use_fork_server()`), `procs.spawn` starts `python [-u] -m MODULE ...` and
`python [-u] SCRIPT ...` commands as forks of one server that has imported those modules;
anything else (and anything the server cannot reproduce exactly) is started as before.

What the started process sees is what a fresh interpreter would have given it:
- its pid is the one the caller's Popen holds, and its parent is the caller: the server forks
  twice and the middle process exits, so the command is reparented to the caller, which is
  marked a child subreaper (PR_SET_CHILD_SUBREAPER); Popen's wait, poll, exit codes and
  signals work unchanged, and the command starts only once the caller is its parent;
- its own session when asked, the caller's stdin, stdout and stderr (passed over the socket),
  no other file descriptor, its environment, working directory, argv and sys.path;
- at its end: non-daemon threads joined, exit handlers run, streams flushed, the exit code of
  SystemExit, or death by the signal that killed it.
The difference: modules imported by the server are not imported again, so an environment
variable read at import time (thread counts, torch's and Python's own) must be the same as the
server's; a command whose environment differs in one of those gets a server of its own (in a
launcher's nursery: a fresh start). A command behind `ip netns exec NS` joins that namespace.

Only the caller's subreaper mark changes how its own subtree behaves: a process orphaned
below it is reparented to it, not to init, and stays a zombie until the caller exits (harmless
for tests: a zombie runs nothing and `proctree.alive` counts it as gone).
"""

from chaos.forks.client import ForkedPopen, ForkServers, set_servers

__all__ = ["ForkServers", "ForkedPopen", "set_servers"]
