"""The key layout of the launcher's store, shared by the supervisor's agent and the workers.

The agent (resilient/supervisor/) and the workers never import each other; they meet in the
store that torch elastic's rendezvous hosts. Every key either side reads or writes is built
here, so the two cannot drift apart:

    resilient/round[/<restart>]                     the attempt id an agent proposed for a round
    resilient/attempt_<a>[/gen_<g>]/...             one generation's process groups (PrefixStore)
      .../watchdog/hb/<rank>                        heartbeats (hang/watchdog.py)
      .../watchdog/meta/<rank>                      host, pid and start time of a rank
      .../watchdog/verdict                          the group's one verdict (hang/verdict.py)
      .../watchdog/left                             survivors that left the generation, with
                                                    their connections' endpoints (hang/departed.py)
    resilient/attempt_<a>/hot/gen                   the newest generation the agent published
      .../hot/gen_<g>/arrived/<rank>|count|all      the roll call of generation g (hot/reform.py)
      .../hot/gen_<g>/formed|stepped|replaced       marks of generation g's progress
      .../hot/replica/rank_<r>                      a rank's per-rank state (replicas=0)
      .../hot/raised/<rank>/<step>/<kind>/<split>   how often one failure was replaced

On a store apart from the job (`resilient rendezvous`, supervisor/rdzv.py), outside any
rendezvous round:

    resilient/server                                what serves the store (pid, host, start)
    resilient/job/<rdzv id>                         the job that holds that rendezvous id
"""

from __future__ import annotations

from dataclasses import dataclass

ROUND = "resilient/round"
"""Where an agent proposes the attempt id of a rendezvous round (supervisor/agent.py)."""

SERVER = "resilient/server"
"""Set by `resilient rendezvous` (supervisor/store_server.py): the store is one apart from the
job; its value says which process serves it."""

WATCHDOG = "watchdog"
"""Under a generation's prefix: the watchdog's keys (its own PrefixStore)."""
VERDICT = "verdict"
"""Inside the watchdog's prefix: the group's verdict."""
CLAIM = "claim"
"""Inside the watchdog's prefix: a counter; who adds the first 1 writes the verdict."""
LEFT = "left"
"""Inside the watchdog's prefix: one JSON line per survivor that left the generation for the
next one (its rank and its connections' local endpoints), appended."""


def round_key(restart: int | None = None) -> str:
    """The round key; per restart count when the rendezvous is static."""
    return ROUND if restart is None else f"{ROUND}/{restart}"


def job_claim(run_id: str) -> str:
    """Which job holds rendezvous id `run_id` on a shared store (supervisor/rdzv.py)."""
    return f"resilient/job/{run_id}"


def worker_prefix(attempt: str, generation: int = 0) -> str:
    """One attempt's generation: the workers' process groups and their watchdog live under it
    (groups/groups.py)."""
    return f"resilient/attempt_{attempt}" + (f"/gen_{generation}" if generation else "")


def heartbeat(rank: int) -> str:
    """Inside the watchdog's prefix: rank's heartbeat."""
    return f"hb/{rank}"


def meta(rank: int) -> str:
    """Inside the watchdog's prefix: rank's host, pid and start time."""
    return f"meta/{rank}"


def learned(rank: int) -> str:
    """Inside the watchdog's prefix: rank's learned timeouts (hang/learned.py)."""
    return f"learned/{rank}"


LEARNED_AGREED = "learned/agreed"
"""Inside the watchdog's prefix: the learned timeouts every rank agreed on (rank 0 sets it)."""


def watchdog_prefix(attempt: str, generation: int) -> str:
    """The watchdog's prefix as seen from the base store."""
    return f"{worker_prefix(attempt, generation)}/{WATCHDOG}"


def watchdog_key(attempt: str, generation: int, key: str) -> str:
    """A watchdog key (heartbeat(), meta(), VERDICT) as seen from the base store."""
    return f"{watchdog_prefix(attempt, generation)}/{key}"


@dataclass(frozen=True)
class HotKeys:
    """The keys of one attempt's hot recoveries: the agent publishes generations, the workers
    their roll call, replicas and progress marks."""

    attempt: str

    @property
    def prefix(self) -> str:
        return f"resilient/attempt_{self.attempt}/hot"

    def published(self) -> str:
        """The newest generation the agent started (an integer as text)."""
        return f"{self.prefix}/gen"

    def arrived(self, generation: int, rank: int | str) -> str:
        """The roll call of `generation`: a rank's arrival, or "count" and "all"."""
        return f"{self.prefix}/gen_{generation}/arrived/{rank}"

    def formed(self, generation: int) -> str:
        """Set by rank 0 once every rank of `generation` restored its state."""
        return f"{self.prefix}/gen_{generation}/formed"

    def stepped(self, generation: int) -> str:
        """Set by rank 0 once the first step of `generation` closed."""
        return f"{self.prefix}/gen_{generation}/stepped"

    def script_store(self, generation: int) -> str:
        """Set by rank 0: "host:port" of the store it hosts for `generation`'s own process
        group, the one a script makes itself (hot/script_store.py)."""
        return f"{self.prefix}/gen_{generation}/script_store"

    def replaced(self, generation: int) -> str:
        """Set by the agent: the rank it replaced to start `generation`."""
        return f"{self.prefix}/gen_{generation}/replaced"

    def replica(self, rank: int) -> str:
        """A rank's per-rank snapshot state when snapshots keep no buddy replica."""
        return f"{self.prefix}/replica/rank_{rank}"

    def raised(self, rank: int, step: int, kind: str, split: int) -> str:
        """A counter: how often this rank's failure at this step was replaced."""
        return f"{self.prefix}/raised/{rank}/{step}/{kind}/{split}"
