"""The Ray backend of the feature stream (`train.stream`): `features=ray:NAME`, `angelspec feature-server --ray NAME`.

Ray is an optional extra (`pip install 'angelspec[ray]'`); this module imports it only when called, and says how
to install it when it is missing. Processes and ownership:

* The feature server (:func:`serve_ray`, a Ray driver) starts a broker actor named ``stream:NAME`` and N target
  workers (:class:`_TargetWorker` actors, ``max_restarts=-1``, ``max_task_retries=-1``: a worker killed mid-batch
  is restarted by Ray and its batch computed again). It claims items from the broker (which blocks while every
  attached rank's window is full: the backpressure), asks a worker for each and hands the broker the result's
  object reference at once; the batch itself stays in Ray's object store, on the worker's node, until a trainer
  fetches it.
* The broker (:class:`_Broker`, an async actor) holds the plan, the trainer ranks' cursors and the index of
  published batches; every method runs atomically with respect to the others, so a batch is published once and
  handed to one trainer once (`take` drops it from the index).
* The trainer (:class:`RayFeatureStream`, also a driver) attaches with its plan and step and takes its batches.

The driver owns the batches' objects and the broker (Ray's ownership model), so a feature server killed with
SIGKILL takes its unconsumed batches with it; the trainer sees the broker or an object go, waits for a feature
server under the same name and attaches again at the step it needs: the new server makes the batches from there
(the same bytes: an item is a function of the plan). A trainer killed with SIGKILL attaches again at its
checkpoint step; the batches it consumed after that are made again, the ones still waiting are reused. So the
durable records are the trainer's checkpoint and nothing else, and nothing is lost or handed out twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from angelspec.fileio import pid_alive
from angelspec.models.device import Placement
from angelspec.train.stream import (
    DEFAULT_BUFFER,
    Cursor,
    FeatureProducer,
    Item,
    StreamError,
    StreamPlan,
    all_finished,
    wanted_items,
)

NAMESPACE = "angelspec-features"
INSTALL = "pip install 'angelspec[ray]' (or pip install 'ray[default]')"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise StreamError(f"the Ray feature backend needs Ray, an optional extra: {INSTALL}; the default backend, "
                          "features=stream:DIR, needs nothing extra") from None
    return ray


def connect(address: str) -> str:
    """Join the Ray cluster at `address` once per process (Ray's meaning: "auto" = RAY_ADDRESS, else the cluster
    `ray start` runs on this machine; "local" = a new cluster of this process's own; else HOST:PORT). -> its
    address, for other processes to join."""
    ray = _ray()
    if not ray.is_initialized():
        try:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError as e:
            where = (os.environ.get("RAY_ADDRESS") or "this machine") if address == "auto" else address
            raise StreamError(f"no Ray cluster at {where} "
                              f"({e}); start one with `ray start --head` (other machines: `ray start --address "
                              "HEAD:6379`), or set RAY_ADDRESS") from None
    return ray.get_runtime_context().gcs_address


def _broker_name(name: str) -> str:
    return f"stream:{name}"


class _Broker:
    """The index of a Ray feature stream (module docstring): plan, cursors, published batches, backpressure."""

    def __init__(self, buffer: int, owner: tuple[str, int]) -> None:
        self.buffer, self.owner_id = buffer, owner
        self.plan: dict[str, Any] | None = None
        self.key: str | None = None
        self.world = 1
        self.cursors: dict[int, Cursor] = {}
        self.items: dict[Item, list[Any]] = {}  # (step, rank) -> [object ref of the batch]
        self.claimed: set[Item] = set()  # handed to the server, not yet published
        self.sessions: dict[int, int] = {}  # rank -> id of its latest attach (a killed trainer's calls are stale)
        self.error: str | None = None  # why the feature server cannot serve the plan, for the trainer to raise
        self.cv = asyncio.Condition()

    async def owner(self) -> tuple[str, int]:
        """(host, pid) of the feature server that started this broker."""
        return self.owner_id

    async def attach(self, plan: dict[str, Any], rank: int, step: int, end: int | None) -> int:
        """Rank `rank` reads plan `plan` from `step` to `end`; -> its session id, which its `take` calls carry."""
        async with self.cv:
            if plan["key"] != self.key:  # a new plan: whatever the old one published is stale
                self.plan, self.key, self.world = plan, plan["key"], plan["world_size"]
                self.cursors.clear()
                self.items.clear()
                self.claimed.clear()
                self.error = None
            self.cursors[rank] = Cursor(step, end)
            self.sessions[rank] = self.sessions.get(rank, 0) + 1
            for it in [it for it in self.items if it[1] == rank and it[0] < step]:
                del self.items[it]
            self.cv.notify_all()
            return self.sessions[rank]

    async def fail(self, key: str, error: str) -> None:
        """The feature server cannot serve plan `key` (`error` says why): the trainer's waiting `take` raises it."""
        async with self.cv:
            if key == self.key:
                self.error = error
            self.cv.notify_all()

    async def wait_plan(self, wait_s: float) -> dict[str, Any] | None:
        async with self.cv:
            try:
                await asyncio.wait_for(self.cv.wait_for(lambda: self.plan is not None), wait_s)
            except TimeoutError:
                return None
            return self.plan

    def _next(self) -> Item | None:
        todo = wanted_items(self.cursors, self.world, self.buffer, self.items.keys() | self.claimed)
        return todo[0] if todo else None

    async def claim(self, key: str, wait_s: float) -> Item | str:
        """The next item to make for plan `key`, waiting up to `wait_s` while the windows are full; "wait" after
        that, "replan" when a trainer attached another plan, "done" once every rank has finished."""
        def ready() -> bool:
            return self.key != key or all_finished(self.cursors, self.world) or self._next() is not None

        async with self.cv:
            try:
                await asyncio.wait_for(self.cv.wait_for(ready), wait_s)
            except TimeoutError:
                return "wait"
            if self.key != key:
                return "replan"
            if all_finished(self.cursors, self.world):
                return "done"
            item = self._next()
            assert item is not None
            self.claimed.add(item)
            return item

    async def publish(self, key: str, step: int, rank: int, refs: list[Any]) -> None:
        async with self.cv:
            self.claimed.discard((step, rank))
            c = self.cursors.get(rank)
            if key == self.key and c is not None and step >= c.step:  # else the trainer moved on meanwhile
                self.items[(step, rank)] = refs
            self.cv.notify_all()

    async def take(self, key: str, rank: int, step: int, session: int) -> list[Any] | str:
        """Item (step, rank) once published, and the rank's cursor moves past it; or why not: "replan" (another
        plan took over), "stale" (the rank attached again: this call is a killed trainer's, left waiting here) or
        the feature server's error."""
        def settled() -> bool:
            return ((step, rank) in self.items or self.key != key or self.sessions.get(rank) != session
                    or self.error is not None)

        async with self.cv:
            await self.cv.wait_for(settled)
            if self.key != key:
                return "replan"
            if self.sessions.get(rank) != session:
                return "stale"
            if self.error is not None:
                return self.error
            refs = self.items.pop((step, rank))
            self.cursors[rank] = replace(self.cursors[rank], step=step + 1)
            self.cv.notify_all()
            return refs

    async def finish(self, key: str, rank: int, step: int) -> None:
        async with self.cv:
            if key == self.key and rank in self.cursors:
                self.cursors[rank] = replace(self.cursors[rank], step=step, finished=True)
            self.cv.notify_all()


class _TargetWorker:
    """A target worker actor: a `FeatureProducer` for one plan (rebuilt from the same arguments when Ray restarts
    it after a crash)."""

    def __init__(self, target_dir: str, data: str, plan: dict[str, Any], placement: Placement | None = None) -> None:
        try:
            self.producer: FeatureProducer | None = FeatureProducer(target_dir, data, StreamPlan.from_json(plan),
                                                                    placement)
            self.error = None
        except StreamError as e:  # reported by `ready`, not by a restart loop
            self.producer, self.error = None, str(e)

    def ready(self) -> str | None:
        return self.error

    def item(self, step: int, rank: int) -> dict[str, Any]:
        assert self.producer is not None
        return self.producer.item(step, rank)


_ACTORS: dict[str, Any] = {}


def _actor(kind: str) -> Any:
    """The Ray actor classes, made on first use (Ray is imported only then)."""
    if not _ACTORS:
        ray = _ray()
        _ACTORS["broker"] = ray.remote(num_cpus=0, max_concurrency=1000)(_Broker)
        _ACTORS["worker"] = ray.remote(num_cpus=1, max_restarts=-1, max_task_retries=-1)(_TargetWorker)
    return _ACTORS[kind]


def _start_broker(name: str, buffer: int, wait_s: float = 60.0) -> Any:
    """The broker of stream `name`, started by this server. A broker left by a killed server on this machine is
    removed; one whose server still runs makes this a StreamError."""
    ray = _ray()
    owner = (socket.gethostname(), os.getpid())
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return _actor("broker").options(name=_broker_name(name), namespace=NAMESPACE).remote(buffer, owner)
        except ValueError:  # the name is taken (ActorAlreadyExistsError)
            pass
        try:
            old = ray.get_actor(_broker_name(name), namespace=NAMESPACE)
            host, pid = ray.get(old.owner.remote(), timeout=10)
        except (ValueError, ray.exceptions.RayError):  # gone, or going, meanwhile
            host = pid = None
        if host == owner[0] and pid is not None and not pid_alive(pid):
            ray.kill(old)  # its server was killed; Ray has not reaped it yet
        elif pid is not None and time.monotonic() > deadline:
            raise StreamError(f"stream ray:{name} is already served (pid {pid} on {host}); stop that feature server "
                              "or give this one another name")
        time.sleep(0.2)


def serve_ray(name: str, target_dir: str | Path, data: str | Path, *, workers: int = 1,
              buffer: int = DEFAULT_BUFFER, address: str | None = None, idle_timeout_s: float = 3600.0,
              log: Callable[[str], None] = print, placement: Placement | None = None) -> int:
    """`angelspec feature-server --ray NAME`: serve the Ray feature stream `name` with `workers` target actors on
    the cluster at `address` (`connect`; None = "auto") until every trainer rank has finished (or `idle_timeout_s`
    passes without a plan or a claimed batch); -> the number of batches published. `placement`: the device and dtype
    of the actors' targets (None: each actor's default)."""
    if buffer < 1 or workers < 1:
        raise StreamError(f"--workers and --buffer must be at least 1, got {workers} and {buffer}")
    ray = _ray()
    connect(address or "auto")
    broker = _start_broker(name, buffer)
    log(f"feature stream ray:{name}: waiting for a trainer (features=ray:{name})")
    published, last_change, actors = 0, time.monotonic(), []
    try:
        while True:
            plan_json = ray.get(broker.wait_plan.remote(5.0))
            if plan_json is None:
                if time.monotonic() - last_change > idle_timeout_s:
                    log(f"no trainer attached for {idle_timeout_s:.0f} s; stopping")
                    return published
                continue
            plan = StreamPlan.from_json(plan_json)
            log(f"serving plan {plan.key}: {plan.dataset['rows']} packed rows, batch {plan.batch_size}, "
                f"{plan.world_size} rank(s), layers {list(plan.layer_ids)}; {workers} worker(s), buffer {buffer}")
            for a in actors:
                ray.kill(a)
            actors = [_actor("worker").remote(str(target_dir), str(data), plan_json, placement) for _ in range(workers)]
            for err in ray.get([a.ready.remote() for a in actors]):
                if err is not None:
                    ray.get(broker.fail.remote(plan.key, err))  # the waiting trainer raises it too
                    raise StreamError(err)
            n = 0
            while True:
                claim = ray.get(broker.claim.remote(plan.key, 5.0))
                if claim == "done":
                    log(f"every trainer rank has finished; published {published} batches")
                    return published
                if claim == "replan":
                    break
                if claim == "wait":
                    if time.monotonic() - last_change > idle_timeout_s:
                        log(f"no trainer progress for {idle_timeout_s:.0f} s; stopping after {published} batches")
                        return published
                    continue
                step, rank = claim
                ref = actors[n % workers].item.remote(step, rank)  # a future: the broker indexes it at once
                broker.publish.remote(plan.key, step, rank, [ref])
                n, published, last_change = n + 1, published + 1, time.monotonic()
    finally:
        for a in actors:
            ray.kill(a)


class RayFeatureStream:
    """A trainer rank's end of the Ray feature stream `name` (`train.stream.FeatureStream`). It joins the cluster
    at RAY_ADDRESS, else the one running on this machine, and rides out a feature server's restart (module
    docstring)."""

    def __init__(self, name: str) -> None:
        _ray()  # no Ray: say how to install it before the run starts
        self.name = name
        self.source = f"ray:{name}"
        self.plan: dict[str, Any] | None = None
        self.rank, self.step, self.end = 0, 0, None
        self.log: Callable[[str], None] = print
        self.handle: Any = None
        self.session = 0

    def _join(self) -> None:
        """(Re)attach to the stream's broker at `self.step`, waiting for a feature server to start it."""
        ray = _ray()
        connect("auto")  # RAY_ADDRESS, else the cluster `ray start` runs on this machine
        t0 = last_note = time.monotonic()
        while True:
            try:
                self.handle = ray.get_actor(_broker_name(self.name), namespace=NAMESPACE)
                self.session = ray.get(self.handle.attach.remote(self.plan, self.rank, self.step, self.end))
                return
            except (ValueError, ray.exceptions.RayActorError):  # no broker (yet), or one going away
                pass
            if time.monotonic() - last_note > 60:
                last_note = time.monotonic()
                self.log(f"waiting {last_note - t0:.0f} s for a feature server of ray:{self.name} (angelspec "
                         f"feature-server --ray {self.name} ...)")
            time.sleep(0.2)

    def attach(self, plan: StreamPlan, rank: int, step: int, end: int | None, log: Callable[[str], None]) -> None:
        self.plan, self.rank, self.step, self.end, self.log = plan.to_json(), rank, step, end, log
        self._join()

    def get(self, step: int) -> dict[str, Any]:
        ray = _ray()
        assert self.plan is not None, "attach() first"
        self.step = step
        while True:
            try:
                refs = ray.get(self.handle.take.remote(self.plan["key"], self.rank, step, self.session))
                if refs in ("replan", "stale"):
                    raise StreamError(f"another trainer attached to ray:{self.name} (rank {self.rank}, "
                                      f"{'another plan' if refs == 'replan' else 'the same plan'}); give each run its "
                                      "own stream name")
                if isinstance(refs, str):
                    raise StreamError(f"the feature server of ray:{self.name} failed: {refs}")
                tensors = ray.get(refs[0])
                self.step = step + 1
                return tensors
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as e:
                self.log(f"feature server of ray:{self.name} lost ({type(e).__name__}); attaching again at step "
                         f"{step}")
                self._join()

    def finish(self, step: int) -> None:
        ray = _ray()
        try:
            ray.get(self.handle.finish.remote(self.plan["key"], self.rank, step), timeout=30)
        except ray.exceptions.RayError:  # the server is gone: nothing to stop
            pass
