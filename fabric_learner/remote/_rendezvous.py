"""Where a ``RemoteLearner`` group's rendezvous and collectives listen: on its node's address only.

torch's TCP store (``init_process_group``'s rendezvous) binds its server to every interface
(``*:port``) whatever ``MASTER_ADDR`` says, so any process that reaches the machine could read
and write the group's keys while it trains. Instead, rank 0 binds the listening socket itself,
to its node's Ray address (``listener``), and hosts the store on that socket; every rank,
rank 0 included, joins it as a client, as under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``).
On the embedded runtime the node's address is 127.0.0.1 (``remote._runtime``): then gloo's and
NCCL's own sockets are pinned to the loopback interface too, unless ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` are set; on a cluster they keep their own choice of interface.
"""

from __future__ import annotations

import datetime
import os
import socket


def listener() -> socket.socket:
    """Rank 0: a socket listening on this node's Ray address, at a free port, for the group's store."""
    import ray

    sock = socket.socket(socket.AF_INET6 if ":" in (address := ray.util.get_node_ip_address()) else socket.AF_INET)
    sock.bind((address, 0))
    sock.listen(128)
    return sock


def join(rank: int, world_size: int, address: str, port: int, listening: socket.socket | None, timeout: float):
    """Set this rank's rendezvous environment; rank 0 starts the store on ``listening`` and returns it.

    Keep the store returned for as long as the group lives: it is the group's rendezvous server.
    """
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world_size), TORCHELASTIC_USE_AGENT_STORE="True")
    if address in ("127.0.0.1", "::1"):
        name = loopback_interface()
        if name is not None:
            for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(variable, name)
    if rank != 0:
        return None
    from torch.distributed import TCPStore

    # the store takes the socket's descriptor over (and closes it)
    return TCPStore(address, port, world_size, True, datetime.timedelta(seconds=timeout), wait_for_workers=False,
                    master_listen_fd=listening.detach())


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (Linux), else ``None``."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return None
