"""The Ray instance the reward pools run on: one private instance per node, or a cluster the user gives.

``data.ray_address=None`` (the default): on each node the lowest rank starts a private Ray instance sized
for that node's pools, and the node's other ranks join it; nodes never depend on each other, so neither one
machine nor a cluster needs any set-up, and the instance ends with the run. One instance per node rather
than one per rank: a Ray instance is half a dozen processes and seconds of start-up. ``data.ray_address=ADDR``
joins an existing cluster (started with ``ray start``); its workers then get this process's PYTHONPATH, so a
reward given by import path resolves there too.

Token authentication, Ray's default for a new instance, stays on: the private instance's token is Ray's
default file (``~/.ray/auth_token``, made on first use), which the node's other ranks read.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)

# The rewards' arguments and results are small and travel inline; Ray's default store would reserve 30% of RAM.
OBJECT_STORE_BYTES = 128 * 1024 * 1024
AGENT_START_TIMEOUT_MS = 120_000


def _quiet_auth_notice() -> None:
    """Ray announces its default (token authentication on) in a WARNING on every start: keep it on, quietly."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def start_local_ray(num_cpus: int) -> str:
    """Start a private Ray instance in this process (a head with ``num_cpus`` logical CPUs); returns its address."""
    import ray

    _quiet_auth_notice()
    # The raylet gives its Python agents 15 s to write their first port file and then aborts; they took
    # 20 s on this 2-core machine under load. Ray's own setting, for the raylet this start spawns (a user's
    # value wins); Ray's other start-up limits stay as they are (bench/RESULTS.md, issue 19).
    added = "RAY_agent_register_timeout_ms" not in os.environ
    if added:
        os.environ["RAY_agent_register_timeout_ms"] = str(AGENT_START_TIMEOUT_MS)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                 logging_level=logging.WARNING)
    finally:
        if added:
            del os.environ["RAY_agent_register_timeout_ms"]
    return ray.get_runtime_context().gcs_address


def join_local_ray(address: str) -> None:
    """Join the private instance another rank of this node started, with its token authentication.

    ray.init turns token authentication on (from the token file the instance wrote) only for a local cluster
    it finds itself, never for one given by address, and Ray reads its auth mode once, at import: vLLM
    imports Ray before a rank's code runs. So this process turns it on first, with Ray's own step for that
    case (absent from Ray releases before token authentication, which need none).
    """
    import ray

    _quiet_auth_notice()
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:
        pass
    else:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    ray.init(address=address, logging_level=logging.WARNING)


def join_ray_cluster(address: str) -> None:
    """Join a cluster the user started at ``address`` (authentication as this environment says); its workers
    get this process's PYTHONPATH, so a reward given by import path resolves there too."""
    import ray

    runtime_env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else None
    try:
        ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)
    except ConnectionError as err:
        raise ConnectionError(f"data.ray_address={address}: cannot join that Ray cluster ({err}); is it running "
                              "(`ray start --head`), and is its authentication token in this environment?") from None


class RayConnection:
    """This rank's connection to Ray; ``close`` disconnects it and, where this rank started it, stops the instance."""

    def __init__(self, *, started_here: bool):
        self.started_here = started_here
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        import ray

        self.closed = True
        ray.shutdown()


def connect_ranks(address: str | None, *, hosts_pool: bool, workers_per_pool: int) -> RayConnection | None:
    """Collective over the default process group (a plain process without one starts or joins alone).

    Every rank takes part; the ranks that ``hosts_pool`` get a connection, the others None (except a node's
    lowest rank, which holds the instance it started). Without an ``address`` each node's lowest rank starts an
    instance with one logical CPU per worker of the node's pools (each worker asks for one), and the node's
    other pool ranks join it.
    """
    import torch.distributed as dist

    if address is not None:
        if not hosts_pool:
            return None
        join_ray_cluster(address)
        return RayConnection(started_here=False)
    if not dist.is_initialized():
        start_local_ray(workers_per_pool)
        return RayConnection(started_here=True)
    host, rank, world = socket.gethostname(), dist.get_rank(), dist.get_world_size()
    hosts: list[tuple[str, bool]] = [None] * world
    dist.all_gather_object(hosts, (host, hosts_pool))
    node_ranks = [r for r, (h, _) in enumerate(hosts) if h == host]
    pools_on_node = sum(pool for h, pool in hosts if h == host)
    starts = rank == node_ranks[0] and pools_on_node > 0
    started, failure = None, None
    if starts:
        try:
            started = start_local_ray(pools_on_node * workers_per_pool)
        except Exception as err:  # told to the node's other ranks, which would otherwise wait for an address
            failure = err
        else:
            logger.info("Ray started on %s for %d reward pool(s) of %d workers: %s", host, pools_on_node,
                        workers_per_pool, started)
    addresses: list[tuple[str | None, str | None]] = [None] * world
    dist.all_gather_object(addresses, (started, None if failure is None else f"{type(failure).__name__}: {failure}"))
    if failure is not None:
        raise failure
    if starts:
        return RayConnection(started_here=True)
    if not hosts_pool:
        return None
    address, error = addresses[node_ranks[0]]
    if error is not None:
        raise ConnectionError(f"rank {node_ranks[0]} could not start Ray for this node's reward pools: {error}")
    join_local_ray(address)
    return RayConnection(started_here=False)


def disconnect_ranks(connection: RayConnection | None) -> None:
    """Collective: every rank leaves Ray, the ranks that started an instance last, so no rank still joined to
    an instance sees it stop."""
    import torch.distributed as dist

    if connection is not None and not connection.started_here:
        connection.close()
    if dist.is_initialized():
        dist.barrier()
    if connection is not None:
        connection.close()
