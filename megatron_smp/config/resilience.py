"""ResilienceConfig: the progress watchdog (--enable-ft-package and its timeouts), the fault
injector (--fault-injector-*) and the straggler report (--log-straggler), Megatron-LM main's
flag names; replica groups that leave and rejoin the job (--fault-tolerance-*, torchtitan's
--fault_tolerance.* options over torchft). megatron_smp/resilience reads it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from megatron_smp.config.errors import ConfigError

SECTIONS = ("setup", "step", "checkpointing")
FAULT_TYPES = ("hang", "crash", "slow", "exception")


def parse_section_timeouts(text: str, flag: str = "--ft-rank-section-timeouts"
                           ) -> Dict[str, float]:
    """'setup:600,step:180,checkpointing:420' -> {section: seconds} (nvidia-resiliency-ext's
    ft_launcher syntax); ConfigError naming `flag` for anything else."""
    timeouts: Dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition(":")
        if name not in SECTIONS:
            raise ConfigError(f"{flag}: unknown section {name!r}; the sections are "
                              f"{', '.join(SECTIONS)}")
        try:
            seconds = float(value)
        except ValueError:
            raise ConfigError(f"{flag}: {item!r} is not SECTION:SECONDS") from None
        if seconds <= 0:
            raise ConfigError(f"{flag}: the {name} timeout must be > 0 seconds, got {value}")
        timeouts[name] = seconds
    return timeouts


@dataclass
class ResilienceConfig:
    # -- the progress watchdog (hang detection) -------------------------------------------------
    enable_ft_package: bool = False
    calc_ft_timeouts: bool = False
    ft_num_warmup_iters: int = 5
    # Seconds a rank may stay in one section (nvidia-resiliency-ext's rank_section_timeouts),
    # between sections (rank_out_of_section_timeout), and without a heartbeat from its
    # monitor thread (rank_heartbeat_timeout: a frozen process, a cut link).
    ft_rank_section_timeouts: str = "setup:600,step:180,checkpointing:420"
    ft_rank_out_of_section_timeout: float = 300.0
    ft_rank_heartbeat_timeout: float = 60.0
    ft_heartbeat_interval: float = 1.0
    # -- fault injection (Megatron-LM main's megatron/core/fault_injector.py) ---------------
    fault_injector_ranks: Optional[str] = None
    fault_injector_num_ranks: Optional[int] = None
    fault_injector_fault_types: Optional[str] = None
    fault_injector_fault_probabilities: Optional[str] = None
    fault_injector_fault_delay: Optional[float] = None
    fault_injector_delay_start_iteration: Optional[int] = None
    fault_injector_mtti_seconds: Optional[float] = None
    fault_injector_offset_seconds: Optional[float] = None
    fault_injector_seed: Optional[int] = None
    fault_injector_slow_factor: float = 2.0
    # -- in-process restart (megatron_smp.resilience.inprocess) -------------------------------
    inprocess_restart: bool = False
    inprocess_max_iterations: Optional[int] = None
    inprocess_empty_cuda_cache: bool = False
    # -- stragglers ---------------------------------------------------------------------------
    log_straggler: bool = False
    straggler_minmax_count: int = 1
    disable_straggler_on_startup: bool = False
    straggler_ctrlr_port: int = 65535
    # -- replica groups (torchft; torchtitan's --fault_tolerance.*) -------------------------------
    fault_tolerance: bool = False
    fault_tolerance_replica_id: int = 0
    fault_tolerance_group_size: int = 0
    fault_tolerance_min_replica_size: int = 1
    # The torchft lighthouse (http://HOST:PORT); default: the TORCHFT_LIGHTHOUSE variable.
    fault_tolerance_lighthouse: Optional[str] = None
    fault_tolerance_process_group_timeout_ms: int = 10000

    def section_timeouts(self) -> Dict[str, float]:
        return parse_section_timeouts(self.ft_rank_section_timeouts)

    @property
    def fault_injection(self) -> bool:
        return self.fault_injector_fault_types is not None

    def validate(self, save: Optional[str], world_size: Optional[int] = None,
                 load: Optional[str] = None) -> None:
        """ConfigError for flags that cannot work (pure: every rank, before a collective)."""
        self.section_timeouts()
        for flag, value in (("--ft-rank-out-of-section-timeout",
                             self.ft_rank_out_of_section_timeout),
                            ("--ft-rank-heartbeat-timeout", self.ft_rank_heartbeat_timeout),
                            ("--ft-heartbeat-interval", self.ft_heartbeat_interval)):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0 seconds, got {value}")
        if self.ft_heartbeat_interval * 3 > self.ft_rank_heartbeat_timeout:
            raise ConfigError("--ft-rank-heartbeat-timeout must be at least 3 x "
                              "--ft-heartbeat-interval (a rank is silent only after several "
                              "missed heartbeats)")
        if self.ft_num_warmup_iters < 0:
            raise ConfigError(f"--ft-num-warmup-iters must be >= 0, got "
                              f"{self.ft_num_warmup_iters}")
        if self.calc_ft_timeouts and not self.enable_ft_package:
            raise ConfigError("--calc-ft-timeouts learns the timeouts of --enable-ft-package: "
                              "add it")
        if self.calc_ft_timeouts and not save:
            raise ConfigError("--calc-ft-timeouts keeps the learned timeouts in "
                              "<--save>/ft_state.json: add --save DIR")
        self._validate_fault_injector(world_size)
        self._validate_inprocess(save, load, world_size)
        if self.straggler_minmax_count < 1:
            raise ConfigError(f"--straggler-minmax-count must be >= 1, got "
                              f"{self.straggler_minmax_count}")
        if self.disable_straggler_on_startup and not self.log_straggler:
            raise ConfigError("--disable-straggler-on-startup applies to --log-straggler: "
                              "add it")
        self._validate_fault_tolerance()

    def lighthouse(self) -> Optional[str]:
        """--fault-tolerance-lighthouse, else the TORCHFT_LIGHTHOUSE variable (torchft's)."""
        import os

        return self.fault_tolerance_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE") or None

    def _validate_fault_tolerance(self) -> None:
        defaults = ResilienceConfig()
        given = [name for name in vars(self) if name.startswith("fault_tolerance_")
                 and getattr(self, name) != getattr(defaults, name)]
        if not self.fault_tolerance:
            if given:
                raise ConfigError(f"--{given[0].replace('_', '-')} applies to replica groups: "
                                  "add --fault-tolerance")
            return
        import importlib.util

        if importlib.util.find_spec("torchft") is None:
            raise ConfigError("--fault-tolerance runs on torchft, which is not installed: "
                              "pip install 'megatron_smp[torchft]' (torchft==0.2.0)")
        size, replica = self.fault_tolerance_group_size, self.fault_tolerance_replica_id
        if size < 1:
            raise ConfigError("--fault-tolerance needs --fault-tolerance-group-size N (how many "
                              f"replica groups the job has, >= 1), got {size}")
        if not 0 <= replica < size:
            raise ConfigError(f"--fault-tolerance-replica-id must be in [0, {size - 1}] "
                              f"(--fault-tolerance-group-size {size}), got {replica}")
        if not 1 <= self.fault_tolerance_min_replica_size <= size:
            raise ConfigError(f"--fault-tolerance-min-replica-size must be in [1, {size}], got "
                              f"{self.fault_tolerance_min_replica_size}")
        if self.fault_tolerance_process_group_timeout_ms <= 0:
            raise ConfigError("--fault-tolerance-process-group-timeout-ms must be > 0, got "
                              f"{self.fault_tolerance_process_group_timeout_ms}")
        if not self.lighthouse():
            raise ConfigError("--fault-tolerance needs the torchft lighthouse's address: "
                              "--fault-tolerance-lighthouse http://HOST:PORT or the "
                              "TORCHFT_LIGHTHOUSE variable (start one with torchft_lighthouse "
                              "--min_replicas 1)")

    def _validate_inprocess(self, save: Optional[str], load: Optional[str],
                            world_size: Optional[int]) -> None:
        import os

        if self.inprocess_max_iterations is not None and self.inprocess_max_iterations < 1:
            raise ConfigError(f"--inprocess-max-iterations must be >= 1, got "
                              f"{self.inprocess_max_iterations}")
        if not self.inprocess_restart:
            if self.inprocess_max_iterations is not None or self.inprocess_empty_cuda_cache:
                flag = ("--inprocess-max-iterations" if self.inprocess_max_iterations is not None
                        else "--inprocess-empty-cuda-cache")
                raise ConfigError(f"{flag} applies to --inprocess-restart: add it")
            return
        if not save or not load or os.path.abspath(save) != os.path.abspath(load):
            raise ConfigError("--inprocess-restart resumes from the last checkpoint the run "
                              "saved: give --save DIR and --load DIR with the same DIR")
        if (world_size or 1) > 1 and not os.environ.get("TORCHELASTIC_RESTART_COUNT"):
            raise ConfigError("--inprocess-restart re-forms the process groups in a fresh "
                              "namespace of torchrun's store: launch with torchrun (several "
                              "processes without torchrun are not supported)")

    def _validate_fault_injector(self, world_size: Optional[int]) -> None:
        given = [name for name, value in vars(self).items()
                 if name.startswith("fault_injector_") and value is not None
                 and name != "fault_injector_slow_factor"]
        if not self.fault_injection:
            if given:
                raise ConfigError(f"--{given[0].replace('_', '-')} needs "
                                  f"--fault-injector-fault-types ({', '.join(FAULT_TYPES)})")
            return
        types = [t.strip() for t in self.fault_injector_fault_types.split(",")]
        unknown = [t for t in types if t not in FAULT_TYPES]
        if unknown or not types:
            raise ConfigError(f"--fault-injector-fault-types: unknown {unknown}; choose from "
                              f"{', '.join(FAULT_TYPES)}")
        if self.fault_injector_fault_probabilities is not None:
            try:
                probabilities = [float(p) for p in
                                 self.fault_injector_fault_probabilities.split(",")]
            except ValueError:
                raise ConfigError("--fault-injector-fault-probabilities: comma-separated "
                                  "numbers, one per fault type") from None
            if len(probabilities) != len(types) or min(probabilities) < 0 or \
                    sum(probabilities) <= 0:
                raise ConfigError("--fault-injector-fault-probabilities: one non-negative "
                                  "number per --fault-injector-fault-types entry, not all 0")
        if (self.fault_injector_ranks is None) == (self.fault_injector_num_ranks is None):
            raise ConfigError("give one of --fault-injector-ranks R[,R...] and "
                              "--fault-injector-num-ranks N")
        if self.fault_injector_ranks is not None:
            try:
                ranks = [int(r) for r in self.fault_injector_ranks.split(",")]
            except ValueError:
                raise ConfigError("--fault-injector-ranks: comma-separated ranks") from None
            if world_size is not None and any(not 0 <= r < world_size for r in ranks):
                raise ConfigError(f"--fault-injector-ranks: ranks must be in "
                                  f"[0, {world_size - 1}], got {ranks}")
        elif world_size is not None and not 1 <= self.fault_injector_num_ranks < world_size:
            # Megatron samples them from ranks 1..world-1 (rank 0 keeps logging).
            raise ConfigError(f"--fault-injector-num-ranks must be in [1, {world_size - 1}] "
                              f"(drawn from ranks 1..{world_size - 1}), got "
                              f"{self.fault_injector_num_ranks}")
        if self.fault_injector_fault_delay is None and self.fault_injector_mtti_seconds is None:
            raise ConfigError("fault injection needs --fault-injector-fault-delay SECONDS or "
                              "--fault-injector-mtti-seconds SECONDS")
        if self.fault_injector_mtti_seconds is not None and self.fault_injector_mtti_seconds <= 0:
            raise ConfigError("--fault-injector-mtti-seconds must be > 0")
        if self.fault_injector_slow_factor <= 1:
            raise ConfigError("--fault-injector-slow-factor must be > 1 (how many times longer "
                              "each step of a slowed rank takes)")
