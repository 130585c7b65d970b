"""Statement replay on N processes (`gaaudit verify --distributed N`): the loop runs on every
rank, its model wrapped in DistributedDataParallel (gloo on CPU, NCCL with one GPU per rank),
each rank with its own K micro-batches of one global window of K * N (so the ranks hold
unequal token counts); the all-reduced gradient at the optimizer step is compared with one
full batch of the whole window, through replay.compare."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
from dataclasses import replace
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gaaudit.harness.factory import load_factory, user_model
from gaaudit.harness.gradcheck import relative_error
from gaaudit.harness.replay import Comparison, Replay, _execute, _Session, group_of_one, processes
from gaaudit.harness.replay import compare as compare_replays

STARTUP = 120.0  # seconds a fresh rank may take to import torch and join the group
REPLICA_TOLERANCE = 1e-6  # ranks whose gradients differ more did not all-reduce them


class DistributedError(Exception):
    """`--distributed` cannot run as asked; the message says what to do."""


def _ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    if device.type != "cuda":
        return DistributedDataParallel(model, find_unused_parameters=True)
    ids = [torch.cuda.current_device() if device.index is None else device.index]
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(rank, world_size, backend, address, inbox, outbox, timeout, factory) -> None:
    """A rank: join the group, then replay each job that arrives with this rank's shard."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks meet on the loopback device
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        model = load_factory(*factory) if factory else None
    except Exception as exc:  # noqa: BLE001 - reported to the parent as this rank's failure
        outbox.put(
            (rank, pickle.dumps(f"rank {rank} could not start: {type(exc).__name__}: {exc}"))
        )
        outbox.close()
        outbox.join_thread()  # deliver the message before leaving
        os._exit(1)
    with user_model(model):
        while (message := inbox.get()) is not None:
            plan, filename, shard, k, ignore_index, seed, dtype, limit = pickle.loads(message)
            shard = [{name: t.to(device) for name, t in batch.items()} for batch in shard]
            try:
                result = _execute(
                    plan,
                    filename,
                    shard,
                    k,
                    ignore_index,
                    seed,
                    device,
                    dtype,
                    limit,
                    wrap=partial(_ddp, device=device),
                )
            except Exception as exc:  # noqa: BLE001 - DDP itself failed (e.g. a collective)
                result = Replay(None, f"{type(exc).__name__}: {exc}")
            if result.grads is not None:
                result = replace(result, grads=[g.cpu() for g in result.grads])
            outbox.put((rank, pickle.dumps(result)))
    dist.destroy_process_group()
    os._exit(0)  # skip the seconds-long teardown of a torch interpreter


class Ranks:
    """`world_size` worker processes in one process group, kept for a whole verify run; they
    are restarted after a replay that may have left them out of step (a rank did not answer,
    or the ranks failed differently). `device`: `auto` (CUDA with NCCL when there is one GPU
    per rank, else CPU with gloo), `cpu` or `cuda`. `factory`: load_factory's arguments, for
    the user's model. The processes start at the first replay; close() stops them."""

    def __init__(
        self,
        world_size: int,
        device: str = "auto",
        timeout: float = 60.0,
        factory: tuple[str, str, str] | None = None,
    ):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device == "auto":
            device = "cuda" if gpus >= world_size else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and gpus < world_size:
            raise DistributedError(
                f"--distributed {world_size} --device cuda needs one GPU per process and this "
                f"machine has {gpus}: use --device cpu (gloo) or fewer processes"
            )
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.world_size, self.timeout, self.factory = world_size, timeout, factory
        self._workers: list = []
        self._inboxes: list = []
        self._outbox = None

    def _start(self) -> None:
        context = processes()
        address = f"127.0.0.1:{_free_port()}"
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(self.world_size)]
        self._workers = [
            context.Process(
                target=_serve,
                daemon=True,
                args=(
                    rank,
                    self.world_size,
                    self.backend,
                    address,
                    self._inboxes[rank],
                    self._outbox,
                    self.timeout,
                    self.factory,
                ),
            )
            for rank in range(self.world_size)
        ]
        for worker in self._workers:
            worker.start()

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for inbox in self._inboxes:
            inbox.put(None)
        for worker in (w for w in self._workers if w.pid is not None):
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
                worker.join()
        self._workers, self._inboxes = [], []

    def run(
        self,
        plan,
        filename: str,
        micro: list,
        k: int,
        ignore_index: int,
        seed: int,
        dtype: torch.dtype,
        timeout: float,
    ) -> Replay:
        """Replay `plan` on every rank, rank r with micro-batches r*k .. r*k+k-1 of `micro`;
        rank 0's result when every rank stepped with the same gradients."""
        fresh = not self._workers
        if fresh:
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - e.g. no way to start processes here
                self.close()
                return Replay(None, f"could not start {self.world_size} processes ({exc})")
        settings = (k, ignore_index, seed, dtype, timeout)
        try:
            jobs = [
                pickle.dumps((plan, filename, self._shard(micro, rank, k), *settings))
                for rank in range(self.world_size)
            ]
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            return Replay(None, f"the replay plan cannot be sent to the processes ({exc})")
        for inbox, job in zip(self._inboxes, jobs):
            inbox.put(job)
        result, in_step = self._merge(
            self._collect(timeout + (STARTUP if fresh else 10.0)), timeout
        )
        if not in_step:
            self.close()
        return result

    @staticmethod
    def _shard(micro: list, rank: int, k: int) -> list:
        """Rank `rank`'s micro-batches, on the CPU for the trip."""
        return [{n: t.cpu() for n, t in b.items()} for b in micro[rank * k : (rank + 1) * k]]

    def _collect(self, seconds: float) -> dict:
        deadline, replies = time.monotonic() + seconds, {}
        while len(replies) < self.world_size and time.monotonic() < deadline:
            try:
                rank, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if any(not w.is_alive() and r not in replies for r, w in enumerate(self._workers)):
                    break
                continue
            replies[rank] = pickle.loads(payload)
        return replies

    def _merge(self, replies: dict, timeout: float) -> tuple[Replay, bool]:
        """The run's result, and whether the ranks are still in step: every rank answered, so
        each collective one rank made was matched by the others, and the failures (if any)
        are the same everywhere."""
        missing = [rank for rank in range(self.world_size) if rank not in replies]
        if missing:
            return Replay(None, f"rank {missing[0]} did not finish within {timeout:g} s"), False
        started = [reply for reply in replies.values() if isinstance(reply, str)]
        if started:
            return Replay(None, started[0]), False
        failed = {rank: reply.reason for rank, reply in replies.items() if not reply.ok}
        if len(failed) == self.world_size and len(set(failed.values())) == 1:
            return replies[0], True
        if failed:
            rank = min(failed)
            return replace(replies[rank], reason=f"{failed[rank]} (rank {rank})"), False
        for rank in range(1, self.world_size):
            difference = relative_error(replies[rank].grads, replies[0].grads)
            if difference > REPLICA_TOLERANCE:
                return Replay(
                    None,
                    f"rank {rank} stepped with gradients {difference:.1e} away "
                    "from rank 0's: the loop did not all-reduce them (every "
                    "micro-batch under no_sync?)",
                ), True
        return replies[0], True


class _RankSession(_Session):
    """A _Session whose window holds K micro-batches per rank (`k` counts them all) and whose
    K-micro-batch replays run on `ranks`; the whole-window replay runs here, on one rank."""

    def __init__(
        self, ranks: Ranks, plan, k, micro_batch_size, seed, device, dtype, timeout, packed
    ):
        super().__init__(
            plan, k * ranks.world_size, micro_batch_size, seed, device, dtype, timeout, packed
        )
        self.ranks, self.per_rank = ranks, k

    def replay(self, plan, filename: str, whole: int = 0, after: int = 0) -> Replay:
        """As _Session.replay; `after` is always 0 here (no short-window check)."""
        if not whole:  # each rank's draws are a shard of the window: no short-window check
            result = self.ranks.run(
                plan,
                filename,
                self.window.micro,
                self.per_rank,
                self.window.ignore_index,
                self.seed,
                self.dtype,
                self.timeout,
            )
            return replace(result, drawn=0)
        with group_of_one(self.ranks.backend):
            return _execute(
                plan,
                filename,
                [self.window.full],
                1,
                self.window.ignore_index,
                self.seed,
                self.device,
                self.dtype,
                self.timeout,
                wrap=partial(_ddp, device=self.device),
            )


def compare(
    ranks: Ranks,
    original_source: str,
    patched_source: str,
    loop_line_original: int,
    loop_line_patched: int,
    k: int = 4,
    divisor_names=(),
    *,
    seed: int = 0,
    dtype: str = "float32",
    timeout: float = 60.0,
    packed: bool = False,
    options: dict | None = None,
) -> Comparison:
    """replay.compare with each replay on `ranks`: K micro-batches per rank against the full
    batch of all ranks' data."""
    return compare_replays(
        original_source,
        patched_source,
        loop_line_original,
        loop_line_patched,
        k,
        divisor_names,
        seed=seed,
        device=str(ranks.device),
        dtype=dtype,
        timeout=timeout,
        packed=packed,
        options=options,
        make_session=partial(_RankSession, ranks),
    )
