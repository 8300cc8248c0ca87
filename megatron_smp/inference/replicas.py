"""Data-parallel replicas: several copies of the model serving one request stream.

A job of `dp` data-parallel ranks (and `ep` expert-parallel ranks inside them) holds
`dp // ep` independent copies of the model: the ranks of one *replica* (its tensor and
pipeline ranks, and the expert-parallel ranks that share the tokens of its MoE layers) run one
`InferenceEngine` over their own group and cache. Replicas step in lock-step rounds that the
*coordinator* (global rank 0, the first rank of replica 0) leads:

1. it hands each new request to the replica with the fewest unfinished ones and broadcasts
   the round's hand-outs and aborts to the replicas' first ranks;
2. every replica runs one step of its engine (its other ranks follow that engine's leader);
3. the replicas' first ranks send the coordinator what advanced (new tokens, log-probs,
   finish reasons), which it copies into its own `Request` records.

On the coordinator, `DataParallelEngine` has the engine's interface (`add_request`, `abort`,
`step`, `has_work`, `requests`, `check_request`, `shutdown`, ...), so the server and
`tools/generate.py` drive replicas as they drive one engine. A request's tokens do not depend
on the replica it runs on (each request attends over its own cache; seeded sampling draws
from a generator of its own), so outputs are those of a single copy.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from megatron_smp.config import ConfigError
from megatron_smp.parallel_state import new_group
from megatron_smp.inference.engine import InferenceEngine, Request, RequestIntake
from megatron_smp.inference.sampling import SamplingParams


def replica_groups(state) -> List[List[int]]:
    """The global ranks of each replica, in replica order: the tensor x pipeline ranks of
    `ep` consecutive data-parallel positions (the ranks of one expert-parallel group run the
    same MoE layers together, so they stay in one replica)."""
    from megatron_smp.parallel_state import rank_groups

    if state.cp_size > 1:
        raise ConfigError("inference: --context-parallel-size must be 1")
    # One tp x pp group per data-parallel position, ordered by that position.
    per_dp = rank_groups(state.sizes, ["tp", "pp"])
    ep = state.ep_size
    return [sorted(r for group in per_dp[start:start + ep] for r in group)
            for start in range(0, len(per_dp), ep)]


def num_replicas(state) -> int:
    return state.dp_size // state.ep_size


class DataParallelEngine(RequestIntake):
    """`num_replicas(state)` engines in lock-step rounds (see the module doc).

    make_engine(group) -> this rank's `InferenceEngine` over its replica's process group.
    Collective over all ranks: the constructor, `step()`, `shutdown()`, `run_until_done()`,
    `generate()`. The request API (`add_request`, `abort`, ...) is the coordinator's."""

    def __init__(self, state, make_engine: Callable[[object], InferenceEngine]) -> None:
        groups = replica_groups(state)
        self.rank = dist.get_rank()
        local = None
        for members in groups:  # every rank creates every group, in the same order
            group = new_group(members)
            if self.rank in members:
                local, self.replica = group, groups.index(members)
        self.leaders = [members[0] for members in groups]
        self.leader_group = new_group(self.leaders)
        self.engine = make_engine(local)
        self.num_replicas = len(groups)
        self.coordinator = self.leaders[0]
        self.config = self.engine.config
        self.max_tokens = self.engine.max_tokens
        # The coordinator's records: its own Request per unfinished request (the intake) and
        # the replica each runs on.
        self._init_intake()
        self._replica_of: Dict[int, int] = {}
        # A replica leader's map from its engine's request ids to the coordinator's.
        self._global_id: Dict[int, int] = {}
        self._local_id: Dict[int, int] = {}
        self._sent: Dict[int, int] = {}  # tokens reported per request
        self.steps = 0
        self.num_aborted = 0
        self.served = [0] * self.num_replicas  # requests handed to each replica
        self.num_drafted = 0  # speculative decoding, over all replicas
        self.num_accepted = 0
        self.speculative = self.engine.speculative

    # The engine's interface on the coordinator -----------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.rank == self.coordinator

    @property
    def stop_checker(self):
        return self.engine.stop_checker

    @stop_checker.setter
    def stop_checker(self, checker) -> None:
        self.engine.stop_checker = checker

    @property
    def running(self) -> List[Request]:
        """The requests handed to a replica and not finished."""
        with self._lock:
            return [r for r in self.requests.values() if r.request_id in self._replica_of]

    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt, params)  # every replica's cache has the same size

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self._aborts)

    def _hand_out(self) -> Dict[int, tuple]:
        """{replica: (new [(id, prompt, params)], aborted ids)} for this round; aborted
        requests finish here at once (their replica frees their blocks at its next step)."""
        plan: Dict[int, tuple] = {r: ([], []) for r in range(self.num_replicas)}
        with self._lock:
            for request_id in self._aborts:
                request = self.requests.pop(request_id, None)
                if request is None or request.finished:
                    continue
                request.finish_reason = "abort"
                self.num_aborted += 1
                if request in self.waiting:
                    self.waiting.remove(request)
                else:
                    plan[self._replica_of.pop(request_id)][1].append(request_id)
            self._aborts.clear()
            load = [0] * self.num_replicas
            for replica in self._replica_of.values():
                load[replica] += 1
            for request in self.waiting:
                replica = load.index(min(load))
                load[replica] += 1
                self.served[replica] += 1
                self._replica_of[request.request_id] = replica
                plan[replica][0].append((request.request_id, request.prompt, request.params))
            self.waiting.clear()
        return plan

    def _progress(self, advanced: Sequence[Request]) -> List[tuple]:
        """What a replica leader reports of its engine's advanced requests: (global id, new
        tokens, their log-probs and top alternatives, prompt log-probs (once), finish
        reason, stop string, drafts verified and accepted so far)."""
        report = []
        for request in advanced:
            global_id = self._global_id[request.request_id]
            sent = self._sent.get(global_id)
            prompt = None
            if sent is None and request.prompt_logprobs is not None:
                prompt = (request.prompt_logprobs, request.prompt_top_logprobs)
            sent = sent or 0
            report.append((global_id, request.output[sent:], request.logprobs[sent:],
                           request.top_logprobs[sent:], prompt, request.finish_reason,
                           request.stop_string, request.num_drafted, request.num_accepted))
            self._sent[global_id] = len(request.output)
            if request.finished:
                self._forget(global_id)
        return report

    def _forget(self, global_id: int) -> None:
        del self._global_id[self._local_id.pop(global_id)]
        self._sent.pop(global_id, None)

    def _apply(self, reports: List[List[tuple]]) -> List[Request]:
        advanced = []
        with self._lock:
            for report in reports:
                for (global_id, output, logprobs, tops, prompt, reason, stop_string, drafted,
                     accepted) in report:
                    request = self.requests.get(global_id)
                    if request is None:  # aborted meanwhile
                        continue
                    self.num_drafted += drafted - request.num_drafted
                    self.num_accepted += accepted - request.num_accepted
                    request.num_drafted, request.num_accepted = drafted, accepted
                    request.output.extend(output)
                    request.logprobs.extend(logprobs)
                    request.top_logprobs.extend(tops)
                    if prompt is not None:
                        request.prompt_logprobs, request.prompt_top_logprobs = prompt
                    request.stop_string = stop_string
                    request.finish_reason = reason
                    if reason is not None:
                        del self.requests[global_id]
                        self._replica_of.pop(global_id, None)
                    advanced.append(request)
        return advanced

    # The round (every rank) -------------------------------------------------------------------

    def step(self, stop: bool = False) -> Optional[List[Request]]:
        """One round on every rank: the coordinator's `stop=True` ends every replica (every
        rank returns None); else the coordinator gets the requests that advanced, others []."""
        if self.rank not in self.leaders:  # follow this replica's leader
            return None if self.engine.step() is None else []
        box = [None if stop else self._hand_out()] if self.is_leader else [None]
        if self.num_replicas > 1:
            dist.broadcast_object_list(box, src=self.coordinator, group=self.leader_group)
        plan = box[0]
        if plan is None:
            self.engine.step(stop=True)
            return None
        new, aborted = plan[self.replica]
        for request_id in aborted:
            self.engine.abort(self._local_id[request_id])
            self._forget(request_id)
        for global_id, prompt, params in new:
            local = self.engine.add_request(prompt, params)
            self._global_id[local.request_id], self._local_id[global_id] = global_id, \
                local.request_id
        report = self._progress(self.engine.step() or [])
        reports = [report]
        if self.num_replicas > 1:
            reports = [None] * self.num_replicas if self.is_leader else None
            dist.gather_object(report, reports, dst=self.coordinator, group=self.leader_group)
        if not self.is_leader:
            return []
        self.steps += 1
        return self._apply(reports)

    def run_until_done(self) -> None:
        """Round until the coordinator has nothing left, then stop every rank (collective)."""
        while True:
            if self.step(stop=self.is_leader and not self.has_work) is None:
                return

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Sequence[SamplingParams]) -> List[Request]:
        """As `InferenceEngine.generate`: every rank gets the finished requests in order."""
        if len(params) != len(prompts):
            raise ConfigError("generate: one SamplingParams per prompt")
        requests = [self.add_request(p, q) for p, q in zip(prompts, params)] \
            if self.is_leader else None
        self.run_until_done()
        box = [requests]
        dist.broadcast_object_list(box, src=self.coordinator)
        return box[0]

    def worker_loop(self) -> None:
        """Every rank but the coordinator in a server: follow the rounds until it stops."""
        while self.step() is not None:
            pass

    def shutdown(self) -> None:
        self.step(stop=True)

    def memory_report(self) -> Dict[str, int]:
        return self.engine.memory_report()

    speculation_report = InferenceEngine.speculation_report


__all__ = ["DataParallelEngine", "replica_groups", "num_replicas"]
