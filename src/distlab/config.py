"""The training configuration: one dataclass per concern, one flag per field.

Each field's help text is its documentation and its ``--help`` line
(:mod:`distlab.cli` builds the parser from these classes). Sections group
the fields; the flags stay flat (``--strategy``, ``--fsdp-reshard-after-forward``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from .cli import from_flags, option, section
from .errors import DistlabError
from .models import GPT_PRESETS, META_INIT_FROM_PARAMETERS, MODEL_NAMES, model_input_kind
from .parallel import STRATEGIES


@dataclass
class ModelConfig:
    name: str = option(
        "cnn", "cnn (the reference notes' MNIST CNN), resnet18, or a GPT preset", flag="model", choices=MODEL_NAMES
    )
    seq_len: int = option(64, "GPT models: tokens per sample")
    activation_checkpointing: bool = option(
        False,
        "keep only each shard unit's input in forward and recompute the rest in backward "
        "(torch.utils.checkpoint per GPT block or CNN layer): less activation memory, one more forward",
    )
    compile: bool = option(
        False,
        "torch.compile the model: under ddp the module inside DDP (dynamo then cuts the graph at DDP's buckets), "
        "under fsdp each shard unit; refused by the strategies it does not run with",
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = option(
        "inductor", "--compile: inductor (generated C++ on the CPU: needs a C++ compiler), aot_eager or eager (none)"
    )
    meta_init: Literal["auto", "on", "off"] = option(
        "auto",
        "build the model on the meta device (no memory), shard it, then initialise only this rank's shards; "
        f"auto: under a parameter-sharding strategy from {META_INIT_FROM_PARAMETERS // 10**6}M parameters up",
    )


@dataclass
class DataConfig:
    dataset: Literal["mnist", "cifar10", "synthetic"] = option(
        "synthetic",
        "mnist, cifar10 (torchvision, downloaded into --data-dir when online) or synthetic (offline, same shapes)",
    )
    data_dir: str = option("./data", "where mnist/cifar10 live or are downloaded to")
    download: bool = option(True, "rank 0 downloads mnist/cifar10 into --data-dir when they are missing")
    synthetic_size: int = option(8192, "synthetic: training samples (test set: one eighth)")
    loader: Literal["dataloader", "device"] = option(
        "dataloader", "dataloader (DistributedSampler + DataLoader) or device (whole dataset resident on the device)"
    )
    num_workers: int = option(2, "dataloader: worker processes per rank (keep <= 2 per rank on Kaggle's 4 vCPUs)")
    pin_memory: bool = option(True, "dataloader: page-locked host batches (only with --device cuda)")
    non_blocking: bool = option(True, "dataloader: asynchronous host-to-device copies")
    eval_batch_size: int = option(
        0,
        "samples per rank per evaluation batch (0: --batch-size, so evaluation never holds more logits than training)",
    )


@dataclass
class TrainingConfig:
    epochs: int = option(1, "passes over the training set")
    batch_size: int = option(
        128, "samples per rank per micro-step; the global batch is batch_size x ranks x accum_steps"
    )
    accum_steps: int = option(1, "micro-steps per optimizer step; all but the last skip gradient sync (no_sync)")
    max_steps: int = option(0, "stop each epoch after this many optimizer steps (0: the whole epoch)")
    lr: float = option(1e-3, "learning rate")
    optimizer: Literal["adam", "adamw", "sgd"] = option("adam", "adam, adamw or sgd (momentum 0.9)")
    max_grad_norm: float = option(0.0, "clip the gradients to this norm over all ranks' shards (0: no clipping)")
    seed: int = option(0, "seeds the weights (identical on every rank) and the data order")


@dataclass
class ParallelConfig:
    strategy: str = option(
        "ddp",
        "how the model is wrapped: single (1 rank), ddp (torch DDP), fsdp (FSDP2 fully_shard), or the "
        "course's own naive_ddp / bucketed_ddp (DDP), zero1 / zero2 (optimizer state, then gradients, sharded) "
        "and zero3 (parameters sharded too: FSDP from scratch)",
        choices=list(STRATEGIES),
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "auto (cuda if present), cpu, or cuda; the backend follows: nccl on cuda, gloo on cpu"
    )
    backend: Literal["auto", "gloo", "nccl"] = option(
        "auto", "override the backend: gloo also lets several ranks share one GPU"
    )
    timeout_s: float = option(300.0, "seconds a collective may wait for a peer before the run fails")
    ddp_bucket_cap_mb: float = option(
        0.0,
        "ddp and bucketed_ddp: gradient bucket size in MB (0: torch DDP's default, 25 MB after a first bucket of "
        "1 MB; 25 MB for bucketed_ddp)",
    )
    zero_bucket_cap_mb: float = option(
        5.0,
        "zero1, zero2: gradient bucket size in MB (ZeRO-2 holds about one bucket of whole gradients at a time, "
        "so its size sets how far ZeRO-2's peak falls below ZeRO-1's)",
    )
    ddp_broadcast_buffers: bool = option(
        True, "ddp: copy rank 0's buffers (BatchNorm statistics) to every rank before each forward"
    )
    fsdp_reshard_after_forward: bool = option(
        True,
        "fsdp: free gathered parameters after forward (FULL_SHARD); --no-... keeps them until backward (SHARD_GRAD_OP)",
    )
    fsdp_units: Literal["model", "root"] = option(
        "model",
        "fsdp: model (each of the model's shard units, GPT blocks, ResNet stages or CNN layers, then the root) "
        "or root (one unit: the whole model gathered at once)",
    )
    fsdp_reshard_to: int = option(
        0,
        "fsdp: after forward, keep each parameter gathered over groups of this many ranks (a divisor of the "
        "world size, such as the GPUs of one node), so backward's all-gather stays in the group; "
        "0: --fsdp-reshard-after-forward decides",
    )
    fsdp_replicate: int = option(
        1,
        "fsdp: HSDP, a 2-D mesh of this many replicas (a divisor of the world size), each sharding over "
        "world size / replicas ranks (the GPUs of one node, say): gradients are reduce-scattered inside a replica "
        "and all-reduced across them; 1 shards over every rank",
    )
    fsdp_prefetch: Literal["implicit", "explicit"] = option(
        "implicit",
        "fsdp: implicit (FSDP2's default: backward gathers the next unit early by itself) or explicit "
        "(each unit names the next to gather, forward and backward: set_modules_to_forward/backward_prefetch)",
    )
    fsdp_prefetch_depth: int = option(
        1,
        "fsdp with --fsdp-prefetch explicit: units each one gathers ahead. 1 overlaps what the implicit default "
        "already overlaps (its all-gather is only issued earlier); 2 keeps two all-gathers in flight",
    )
    fsdp_param_dtype: Literal["none", "bf16", "fp16"] = option(
        "none", "fsdp, zero3: MixedPrecisionPolicy dtype of the gathered parameters, so of forward and backward"
    )
    fsdp_reduce_dtype: Literal["fp32", "param"] = option(
        "fp32", "fsdp, zero3 with --fsdp-param-dtype: reduce-scatter gradients in fp32, or in the parameter dtype"
    )
    fsdp_cpu_offload: bool = option(
        False,
        "fsdp: keep parameter shards, gradients and optimizer state in host memory, the optimizer step on "
        "the CPU (CPUOffloadPolicy, pinned on cuda; on a cpu device nothing moves)",
    )
    fsdp_reshard_between_micro_steps: bool = option(
        True,
        "fsdp with --accum-steps: --no-... keeps the gathered parameters across micro-steps (fewer "
        "all-gathers, more memory); they are always freed before the optimizer step",
    )
    zero3_prefetch: int = option(
        0, "zero3: units all-gathered ahead while one computes (0: none; 1: the next, as FSDP2 does by default; 2)"
    )
    zero_collectives: Literal["auto", "torch", "ring"] = option(
        "auto",
        "zero1, zero2, zero3: torch's all-gather/reduce-scatter, the course's hand-written ring, or auto "
        "(the ring on gloo, whose reduce-scatter is a whole all-reduce underneath; torch's on NCCL)",
    )


@dataclass
class PrecisionConfig:
    dtype: Literal["fp32", "fp16", "bf16"] = option(
        "fp32", "fp32, fp16 (autocast + GradScaler; use this on T4) or bf16 (autocast)", flag="precision"
    )


@dataclass
class CheckpointConfig:
    save_model: bool = option(False, "also write the full state dict next to the result file (gathered on rank 0)")
    checkpoint_dir: str = option(
        "",
        "save sharded checkpoints here (torch.distributed.checkpoint: each rank writes its part) as step-N folders, "
        "each published whole by a rename, and a 'latest' file naming the newest",
    )
    checkpoint_every: int = option(
        0,
        "save every this many optimizer steps, and at the end of the run (0: only at the end; needs --checkpoint-dir)",
    )
    resume: str = option(
        "auto",
        "auto: continue from the latest checkpoint in --checkpoint-dir if there is one (what a restarted torchrun "
        "job needs), else start fresh; none: start fresh; or the path of a step-N folder (any number of ranks)",
    )


@dataclass
class FaultConfig:
    fail_at_step: int = option(
        0,
        "fault injection: rank --fail-rank kills itself (SIGKILL) right after this global step (0: never), "
        "in torchrun's first attempt only, so --max-restarts can restart the job",
    )
    fail_rank: int = option(0, "fault injection: the rank that --fail-at-step kills")
    fail_during_save: bool = option(
        False, "fault injection: kill the rank as it starts writing step --fail-at-step's checkpoint instead"
    )


@dataclass
class OutputConfig:
    out: str = option("results", "directory for the result JSON (written by rank 0)")
    run_name: str = option("", "result file name without .json (default: strategy-model-dataset-ranks-device)")
    log_every: int = option(0, "rank 0 prints progress every this many steps (0: about ten times an epoch; -1: never)")


@dataclass
class TrainConfig:
    """Train one model with one strategy and write a result JSON with provenance.

    Everything one training run depends on, in sections."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    training: TrainingConfig = section(TrainingConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    precision: PrecisionConfig = section(PrecisionConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    faults: FaultConfig = section(FaultConfig)
    output: OutputConfig = section(OutputConfig)

    @classmethod
    def from_flags(cls, **flags: Any) -> TrainConfig:
        """``TrainConfig.from_flags(strategy="fsdp", batch_size=8)``: the command line's names, from Python."""
        config = from_flags(cls, **flags)
        config.validate()
        return config

    def validate(self) -> None:
        """Mistakes visible in the configuration alone, each with its fix."""
        t = self.training
        for flag, value in (
            ("--batch-size", t.batch_size),
            ("--accum-steps", t.accum_steps),
            ("--epochs", t.epochs),
        ):
            if value < 1:
                raise DistlabError(f"{flag} must be at least 1, not {value}")
        if self.data.eval_batch_size < 0:
            raise DistlabError(
                f"--eval-batch-size must be 0 (the training batch) or more, not {self.data.eval_batch_size}"
            )
        self._validate_strategy_options()
        self._validate_checkpoint_options()
        if self.model.compile_backend != "inductor" and not self.model.compile:
            backend = self.model.compile_backend
            raise DistlabError(f"--compile-backend {backend} needs --compile: add --compile, or leave the backend out")
        if model_input_kind(self.model.name) == "tokens":
            if self.data.dataset != "synthetic":
                raise DistlabError(
                    f"the GPT models read tokens, not {self.data.dataset} images: use --dataset synthetic"
                )
            longest = GPT_PRESETS[self.model.name].seq_len
            if not 1 <= self.model.seq_len <= longest:
                raise DistlabError(
                    f"{self.model.name} takes sequences of 1 to {longest} tokens, not --seq-len {self.model.seq_len}"
                )

    def _validate_strategy_options(self) -> None:
        """An option the chosen strategy does not read (each names its own: ``Strategy.options``) is refused
        rather than ignored."""
        p = self.parallel
        for field in fields(ParallelConfig):
            value = getattr(p, field.name)
            readers = [name for name, strategy in STRATEGIES.items() if field.name in strategy.options]
            if readers and field.name not in STRATEGIES[p.strategy].options and value != field.default:
                flag = "--" + ("no-" if value is False else "") + field.name.replace("_", "-")
                shown = flag if isinstance(value, bool) else f"{flag} {value}"
                raise DistlabError(
                    f"{shown} configures {' and '.join(readers)}, which --strategy {p.strategy} is not: "
                    f"use --strategy {readers[0]}, or leave the option out"
                )
        if p.fsdp_prefetch_depth < 1 or p.zero3_prefetch < 0:
            raise DistlabError("--fsdp-prefetch-depth is 1 or more, --zero3-prefetch 0 or more: units gathered ahead")
        if p.fsdp_prefetch_depth != 1 and p.fsdp_prefetch != "explicit":
            raise DistlabError("--fsdp-prefetch-depth needs --fsdp-prefetch explicit (implicit prefetch has no depth)")
        if p.fsdp_reshard_to < 0:
            raise DistlabError(f"--fsdp-reshard-to must be a number of ranks (or 0), not {p.fsdp_reshard_to}")
        if p.fsdp_reduce_dtype != "fp32" and p.fsdp_param_dtype == "none":
            raise DistlabError("--fsdp-reduce-dtype param needs a low-precision --fsdp-param-dtype (bf16 or fp16)")

    def _validate_checkpoint_options(self) -> None:
        c, f = self.checkpoint, self.faults
        if c.checkpoint_every < 0:
            raise DistlabError(f"--checkpoint-every must be a number of steps (or 0), not {c.checkpoint_every}")
        if c.checkpoint_every and not c.checkpoint_dir:
            raise DistlabError("--checkpoint-every needs --checkpoint-dir DIR: where should the checkpoints go?")
        if f.fail_during_save and not (c.checkpoint_dir and f.fail_at_step):
            raise DistlabError(
                "--fail-during-save needs --checkpoint-dir and --fail-at-step (the step whose save dies)"
            )
        if f.fail_at_step < 0 or f.fail_rank < 0:
            raise DistlabError("--fail-at-step and --fail-rank take a step and a rank (0 or more)")

    def eval_batch_size(self) -> int:
        """Samples per rank per evaluation batch. By default a training micro-step's: a GPT's logits grow with
        the vocabulary (gpt-small, 512 sequences of 128 tokens: 13 GB), and evaluation must fit where training did."""
        return self.data.eval_batch_size or self.training.batch_size

    def run_name(self, world_size: int, device_type: str) -> str:
        """The result file's name: ``--run-name``, or what the run was."""
        return (
            self.output.run_name
            or f"{self.parallel.strategy}-{self.model.name}-{self.data.dataset}-{world_size}x{device_type}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
