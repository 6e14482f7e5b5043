"""The ranks' replay buffers as a writer torchrl's ``RayCollector`` accepts.

``RayCollector(replay_buffer=...)`` takes a buffer served on Ray (``service_backend == "ray"``)
and hands each of its collectors a client from ``clients(n)``; the collector then calls
``extend`` (or ``add``, one step at a time, with ``extend_buffer=False``) and reads
``write_count``. Here each client writes into one rank's buffer, so collected batches go from a
collector's process straight to the rank that samples them, never through the controller. A rank
runs one call at a time: a write waits for the update running there, and an update never sees
half a write.
"""

from __future__ import annotations

from typing import Any


class RankBuffers:
    """The replay buffers of a ``RemoteLearner``'s ranks (``learner.replay_buffer``); clients for collectors."""

    service_backend = "ray"

    def __init__(self, actors: list[Any]) -> None:
        self._actors = list(actors)

    def client(self, index: int = 0) -> RankBufferClient:
        """A picklable writer into rank ``index % num_learners``'s buffer."""
        return RankBufferClient(self._actors[index % len(self._actors)])

    def clients(self, num_clients: int) -> list[RankBufferClient]:
        """One writer per collector, dealt over the ranks in turn (collector ``i`` to rank ``i % num_learners``).

        Refuses fewer collectors than ranks: a rank without one would never be filled, and every
        ``update_from_buffer`` would fail on its empty buffer.
        """
        ranks = len(self._actors)
        if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < ranks:
            raise ValueError(f"{num_clients!r} collectors cannot fill the replay buffers of {ranks} learner ranks: "
                             f"start at least {ranks} (a multiple of {ranks} fills them evenly), or fill the others "
                             "with learner.extend(batch). Nothing was started.")
        return [self.client(i) for i in range(num_clients)]

    def __len__(self) -> int:
        import ray

        return sum(ray.get([actor.buffer_length.remote() for actor in self._actors]))


class RankBufferClient:
    """Writes into one rank's replay buffer from any process of the Ray runtime (a collector's)."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def extend(self, data) -> int:
        import ray

        from fabric_learner.remote._wire import packed

        return ray.get(self._actor.extend.remote(packed(data.to("cpu"))))  # a collector's leaves may be on its GPU

    def add(self, data) -> int:
        return self.extend(data.unsqueeze(0))

    @property
    def write_count(self) -> int:
        """Rows written into this client's rank's buffer (torchrl's collectors compare it with their
        ``init_random_frames``: per rank here, where a single shared buffer counts them all)."""
        import ray

        return ray.get(self._actor.buffer_write_count.remote())
