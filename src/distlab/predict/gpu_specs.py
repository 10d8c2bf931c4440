"""Cited hardware inputs for the cost model's GPU predictions: spec sheets, papers and published benchmarks.

Nothing here was measured by this repository and nothing here predicts: these are the *inputs* the cost model
(compute + communication - overlap, memory per rank) reads to predict DDP and FSDP on GPUs nobody here ran. Each
number has a source in its object's ``sources`` (field -> title, address, what it says); ``ASSUMPTION`` marks one
derived from a cited figure or standing in for a missing one, with the reasoning. Units: bytes, bytes/s, FLOP/s,
seconds; GB = 1e9 bytes, GiB = 2**30. NVIDIA's sheets quote tensor FLOP/s "with sparsity" (2:4, twice dense);
these are dense. What a GPU lacks (TF32, BF16 tensor cores on Turing) is None. Import does not need torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

GiB, MiB = 1 << 30, 1 << 20

# Cited text, laid out to be read (one source a line): the formatter leaves it as it is.
# fmt: off
# The documents cited more than once.
T4_SHEET = ("NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
            "tesla-t4/t4-tensor-core-datasheet-951643.pdf")
A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/"
              "a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, and NVIDIA Ampere Architecture "
              "In-Depth, https://developer.nvidia.com/blog/nvidia-ampere-architecture-in-depth/ (Table 1, A100 SXM4)")
H100_SHEET = ("NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/"
              "nvidia-tensor-core-gpu-datasheet (H100 SXM column; '* With sparsity')")
H200_PAGE = ("NVIDIA H200 Tensor Core GPU, product page and datasheet, https://www.nvidia.com/en-us/data-center/h200/ "
             "(H200 SXM column; tensor-core figures footnoted 'With sparsity')")
MLPERF_H200 = ("MLCommons inference v4.1, NVIDIA's system description 'H200-SXM-141GBx8', https://github.com/mlcommons/"
               "inference_results_v4.1/blob/main/closed/NVIDIA/systems/H200-SXM-141GBx8_TRT_MaxQ.json: "
               "'accelerator_host_interconnect': 'PCIe Gen5 x16', 'accelerator_interconnect': '18x 4th Gen NVLink, "
               "900GB/s', 'accelerator_memory_capacity': '141 GB', 'accelerators_per_node': 8")
SMI_TOTALS = ("modal-labs/modal-client PR #2797 'nvidia quotes GB on their GPUs not GiB', "
              "https://github.com/modal-labs/modal-client/pull/2797: nvidia-smi totals")
SGLANG_552 = ("sgl-project/sglang issue #552, https://github.com/sgl-project/sglang/issues/552: 'peer access is "
              "not supported between these two devices' on a Kaggle 2xT4")
NCCL_TUNING = ("NCCL's own cost model, src/graph/tuning.cc, https://github.com/NVIDIA/nccl/blob/"
               "b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2/src/graph/tuning.cc: 'Latencies in us'; baseLat Ring/Simple "
               "8.4; hwLat Ring/Simple 3.4 (NVLink), 5.7 (PCI); a ring collective costs baseLat + nsteps * hwLat")
AUTODL_2080TI = ("Anthony-Hoo, 'AutoDL GPU container multi-GPU interconnect test, 2080Ti x2', https://github.com/"
                 "Anthony-Hoo/Anthony-Hoo.github.io/blob/main/posts/AutoDL_Multi-GPU_Interconnection_Test.md: "
                 "2x RTX 2080 Ti (Turing), PCIe Gen3 x16 (topo PIX), peer access 'NS' (not supported), CUDA 12.4")
LLM_FOUNDRY = ("MosaicML llm-foundry, 'MPT Training Benchmarks', https://github.com/mosaicml/llm-foundry/blob/"
               "061f2c7ce64e655100286584a7629e2a09f827ba/scripts/train/benchmarking/README.md")
PALM = ("Chowdhery et al., 'PaLM: Scaling Language Modeling with Pathways', https://arxiv.org/abs/2204.02311, "
        "Table 3 (MFU): GPT-3 175B on V100 21.3%, Gopher 32.5%, Megatron-Turing NLG 530B on A100 30.2%, PaLM 46.2%")


# fmt: on
@dataclass(frozen=True)
class GPU:
    """One GPU's cited peaks. FLOP/s are dense; ``mfu`` is the assumed achieved fraction of ``fp16_flops``
    (= bf16 where it exists) in transformer training. ``usable_memory_bytes`` is the total CUDA reports
    (``torch.cuda.get_device_properties(i).total_memory``), where one is cited: a few hundred MiB under
    nvidia-smi's total, ECC and driver reservations out. Where none is cited it is nvidia-smi's, and its source
    says so. The CUDA context (a few hundred MiB more) is not taken out."""

    name: str
    memory_bytes: int
    usable_memory_bytes: int
    fp32_flops: float
    tf32_flops: float | None
    fp16_flops: float
    bf16_flops: float | None
    memory_bandwidth: float
    mfu: float
    sources: Mapping[str, str] = field(repr=False)

    def peak_flops(self, precision: str) -> float:
        """The cited dense peak for 'fp32', 'tf32', 'fp16' or 'bf16'; ValueError where the GPU has none."""
        value = getattr(self, f"{precision}_flops")
        if value is None:
            raise ValueError(f"{self.name} has no {precision} peak: {self.sources[f'{precision}_flops']}")
        return value


@dataclass(frozen=True)
class System:
    """A node: ``count`` GPUs and what connects them. Bandwidths are per GPU; ``link_bandwidth`` is the
    theoretical rate in one direction, the ``*_busbw`` figures are nccl-tests "busbw" (bus bandwidth, which
    nccl-tests normalises so that it compares with a link's rate) for large messages."""

    name: str
    gpu: GPU
    count: int
    interconnect: str
    link_bandwidth: float
    allreduce_busbw: float
    gather_busbw: float
    alpha_step_s: float
    alpha_base_s: float
    sources: Mapping[str, str] = field(repr=False)


# fmt: off
T4 = GPU(
    name="NVIDIA T4 (16 GB, PCIe)",
    memory_bytes=16 * GiB,
    usable_memory_bytes=int(14.75 * GiB),
    fp32_flops=8.1e12,
    tf32_flops=None,
    fp16_flops=65e12,
    bf16_flops=None,
    memory_bandwidth=300e9,
    mfu=0.213,
    sources=MappingProxyType({
        "memory_bytes": f"{T4_SHEET}: 'GPU Memory 16 GB GDDR6'; nvidia-smi shows 15360MiB with ECC on ({SMI_TOTALS}).",
        "usable_memory_bytes": "CUDA's total: 'name: Tesla T4 ... deviceMemorySize: 14.75GiB' in a TensorFlow log "
                               "quoted in https://github.com/NVIDIA/DALI/issues/1813 (nvidia-smi shows 15360MiB, "
                               f"{SMI_TOTALS}).",
        "fp32_flops": f"{T4_SHEET}: 'Single-Precision 8.1 TFLOPS' (also composer's speed_monitor.py table).",
        "tf32_flops": "Not available: TF32 tensor cores arrived with Ampere; the Ampere In-Depth Table 1 lists "
                      "'Peak TF32 Tensor TFLOPS: NA' for the previous generation, and the T4 sheet lists none.",
        "fp16_flops": f"{T4_SHEET}: 'Mixed-Precision (FP16/FP32) 65 TFLOPS' (FP16 tensor cores, FP32 accumulate).",
        "bf16_flops": "Not available: Turing tensor cores do FP16, INT8, INT4 (T4 sheet: 65 TFLOPS, 130/260 TOPS); "
                      "BF16 tensor cores arrived with Ampere. torch.cuda.is_bf16_supported() may still say True: "
                      "bf16 then runs emulated, so on a T4 use fp16 autocast with a GradScaler.",
        "memory_bandwidth": f"{T4_SHEET}: '16 GB GDDR6, 300 GB/sec' (TechPowerUp's 256-bit x 10 Gbps gives 320).",
        "mfu": f"ASSUMPTION: no published training MFU for T4 was found. Taken as the lowest figure in {PALM} "
               "(GPT-3 on V100, the previous tensor-core generation): 0.213. The T4 is a 70 W card; calibrate "
               "against a Kaggle run before trusting it.",
    }),
)

A100_40GB = GPU(
    name="NVIDIA A100 40 GB (SXM4)",
    memory_bytes=40 * GiB,
    usable_memory_bytes=42405855232,
    fp32_flops=19.5e12,
    tf32_flops=156e12,
    fp16_flops=312e12,
    bf16_flops=312e12,
    memory_bandwidth=1555e9,
    mfu=0.43,
    sources=MappingProxyType({
        "memory_bytes": f"{A100_SHEET}: 'Memory Size 40 GB' (HBM2, 5120-bit).",
        "usable_memory_bytes": "CUDA's totalGlobalMem: deviceQuery on an A100 40GB SXM4 node gives 40441 MBytes "
                               "(42405855232 bytes), Paderborn PC2 docs 'NVIDIA A100 40GB with NVLINK' "
                               f"(nvidia-smi shows 40960MiB, {SMI_TOTALS}).",
        "fp32_flops": f"{A100_SHEET}: 'Peak FP32 TFLOPS 19.5'.",
        "tf32_flops": f"{A100_SHEET}: 'Peak TF32 Tensor TFLOPS 156/312' (dense/sparse).",
        "fp16_flops": f"{A100_SHEET}: 'Peak FP16 Tensor TFLOPS with FP32 Accumulate 312/624' (dense/sparse).",
        "bf16_flops": f"{A100_SHEET}: 'Peak BF16 Tensor TFLOPS with FP32 Accumulate 312/624' (dense/sparse).",
        "memory_bandwidth": f"{A100_SHEET}: 'Memory Bandwidth 1555 GB/sec' (A100 40GB).",
        "mfu": f"{LLM_FOUNDRY}, table 'A100 40GB': MPT-125M, seq 2048, 8 GPUs, bf16, FSDP FULL_SHARD: MFU 42.75 "
               f"(350M: 49.17). Lower at scale: Megatron-Turing NLG on A100, 30.2% ({PALM}). An end-to-end "
               "figure: it already contains the communication FSDP did not hide.",
    }),
)

H100_SXM = GPU(
    name="NVIDIA H100 80 GB (SXM5)",
    memory_bytes=80 * GiB,
    usable_memory_bytes=81559 * MiB,
    fp32_flops=67e12,
    tf32_flops=989e12 / 2,
    fp16_flops=1979e12 / 2,
    bf16_flops=1979e12 / 2,
    memory_bandwidth=3.35e12,
    mfu=0.35,
    sources=MappingProxyType({
        "memory_bytes": f"{H100_SHEET}: 'GPU memory 80GB' (HBM3).",
        "usable_memory_bytes": f"nvidia-smi's total, no CUDA figure found: {SMI_TOTALS}: 'H100: 81559MiB "
                               "(85.52 GB)'. CUDA reports a few hundred MiB less, as on the T4 and the A100.",
        "fp32_flops": f"{H100_SHEET}: 'FP32 67 teraFLOPS'.",
        "tf32_flops": f"{H100_SHEET}: 'TF32 Tensor Core 989 teraFLOPS*' with sparsity; dense is half. Hopper "
                      "whitepaper gives 494.7 dense at its boost clock.",
        "fp16_flops": f"{H100_SHEET}: 'FP16 Tensor Core 1,979 teraFLOPS*' with sparsity; dense is half (989.5).",
        "bf16_flops": f"{H100_SHEET}: 'BFLOAT16 Tensor Core 1,979 teraFLOPS*' with sparsity; dense is half.",
        "memory_bandwidth": f"{H100_SHEET}: 'GPU memory bandwidth 3.35TB/s'.",
        "mfu": f"{LLM_FOUNDRY}, table 'H100 80GB BF16': MPT-760M (the smallest listed), seq 2048, 8 GPUs, amp_bf16, "
               "FSDP FULL_SHARD: MFU 34.9 (1B: 41.82). At scale: 38-43% BF16 MFU on 8K-16K H100s, Llama Team, "
               "'The Llama 3 Herd of Models', https://arxiv.org/abs/2407.21783, Table 4. End-to-end, as above.",
    }),
)

H200_SXM = GPU(
    name="NVIDIA H200 141 GB (SXM5)",
    memory_bytes=141 * GiB,
    usable_memory_bytes=143156 * MiB,
    fp32_flops=67e12,
    tf32_flops=989e12 / 2,
    fp16_flops=1979e12 / 2,
    bf16_flops=1979e12 / 2,
    memory_bandwidth=4.8e12,
    mfu=0.35,
    sources=MappingProxyType({
        "memory_bytes": f"{H200_PAGE}: 'GPU Memory 141GB' (HBM3e); {MLPERF_H200}. nvidia-smi shows 143771MiB.",
        "usable_memory_bytes": "CUDA's total: \"_CudaDeviceProperties(name='NVIDIA H200', major=9, minor=0, "
                               "total_memory=143156MB, multi_processor_count=132, ...)\" (torch prints MiB) in "
                               "ai-bot-pro/achatbot, deploy/modal/src/llm/vllm/vlm/skywork_r1v.py at 859e216, "
                               "https://github.com/ai-bot-pro/achatbot/blob/859e21612de769164d8d1802d794ef8f87ace3c8/"
                               "deploy/modal/src/llm/vllm/vlm/skywork_r1v.py.",
        "fp32_flops": f"{H200_PAGE}: 'FP32 67 TFLOPS'.",
        "tf32_flops": f"{H200_PAGE}: 'TF32 Tensor Core 989 TFLOPS' with sparsity; dense is half, as on the H100.",
        "fp16_flops": f"{H200_PAGE}: 'FP16 Tensor Core 1,979 TFLOPS' with sparsity; dense is half (989.5), the "
                      "H100 SXM's: the same GH100 die.",
        "bf16_flops": f"{H200_PAGE}: 'BFLOAT16 Tensor Core 1,979 TFLOPS' with sparsity; dense is half.",
        "memory_bandwidth": f"{H200_PAGE}: 'GPU Memory Bandwidth 4.8TB/s'.",
        "mfu": "ASSUMPTION: no published training MFU for the H200 was found. Taken as the H100 SXM's (0.35, "
               f"{LLM_FOUNDRY}, table 'H100 80GB BF16'): the same die, clocks and tensor-core peaks; the H200's "
               "larger, faster memory speeds memory-bound work, not the tensor cores. Like every MFU here it "
               "holds for large steps: a step of a few thousand tokens on a small model is launch-bound and "
               "reaches a small fraction of it.",
    }),
)

GPUS = {"T4": T4, "A100-40GB": A100_40GB, "H100-SXM": H100_SXM, "H200-SXM": H200_SXM}

PCIE3_X16 = 8e9 * 128 / 130 * 16 / 8  # 8 GT/s per lane, 128b/130b encoding, 16 lanes, bits -> bytes: 15.75 GB/s

KAGGLE_T4X2 = System(
    name="Kaggle 'GPU T4 x2'",
    gpu=T4,
    count=2,
    interconnect="PCIe 3.0 x16 per GPU, peer-to-peer between the two T4s reported missing: NCCL stages through host "
    "shared memory",
    link_bandwidth=PCIE3_X16,
    allreduce_busbw=4.0e9,
    gather_busbw=3.8e9,
    alpha_step_s=5.7e-6,
    alpha_base_s=8.4e-6,
    sources=MappingProxyType({
        "count": f"Kaggle 'GPU T4 x2' accelerator (2x T4); peer access reported unavailable on it: {SGLANG_552}.",
        "link_bandwidth": f"{T4_SHEET}: 'System Interface x16 PCIe Gen3', 'Interconnect Bandwidth 32 GB/sec' (both "
                          "directions). PCI-SIG PCIe 3.0: 8 GT/s per lane, 128b/130b -> 15.75 GB/s per direction "
                          "for x16 (as distlab.predict.streams.pcie_GBps(3)).",
        "allreduce_busbw": f"ASSUMPTION (proxy, not T4s): {AUTODL_2080TI}; nccl-tests all_reduce_perf -g 2, float "
                           "sum: busbw 4.00 GB/s from 128 MB to 1 GB. Same path as Kaggle's (PCIe 3 x16, no P2P, "
                           "NCCL through host memory); Kaggle's 4-vCPU host and /dev/shm may differ.",
        "gather_busbw": f"ASSUMPTION (proxy): {AUTODL_2080TI}; all_gather_perf -g 2: busbw 3.79 GB/s at 1 GB "
                        "(algbw 7.58). reduce_scatter not published there; taken as equal.",
        "alpha_step_s": f"{NCCL_TUNING}; PCI, since NCCL models a non-NVLink path as PCI. Proxy check: the "
                        "2-GPU all_reduce of 8 bytes took 11.6-12.3 us on the 2080 Ti pair above.",
        "alpha_base_s": NCCL_TUNING,
    }),
)

A100X2 = System(
    name="2x A100 40 GB SXM4 (two GPUs of an HGX/DGX A100, NVSwitch)",
    gpu=A100_40GB,
    count=2,
    interconnect="NVLink 3 (12 links per GPU) through NVSwitch",
    link_bandwidth=300e9,
    allreduce_busbw=230e9,
    gather_busbw=230e9,
    alpha_step_s=3.4e-6,
    alpha_base_s=8.4e-6,
    sources=MappingProxyType({
        "count": "ASSUMPTION on form factor: SXM4 on an HGX A100 board, as cloud A100 40GB shapes are (GCP's GPU "
                 "table, as copied in huggingface.co/spaces/Elfsong/gcp_allocator: 'A100 40GB | 40 GB HBM2 @ 1.6 "
                 "TBps | ... | NVLink Full Mesh @ 600 GBps'). A100 PCIe cards have NVLink only through a 2-GPU "
                 "bridge (NVIDIA's NVLink page, https://www.nvidia.com/de-de/data-center/nvlink/, translated: "
                 "'NVLink is also available in A100 PCIe configurations with two GPUs'), which a rented pair may "
                 "lack; without it they would talk over PCIe 4 x16 (31.5 GB/s per direction).",
        "link_bandwidth": "NVIDIA NVLink page above, translated: 'A single NVIDIA A100 Tensor Core GPU supports up to "
                          "twelve third-generation NVLink connections for a total bandwidth of 600 GB/s'; sjeaugey "
                          "(NVIDIA), https://github.com/NVIDIA/nccl-tests/issues/149: 'Each NVLink has a line rate "
                          "of 25GB/s (in each direction)' -> 12 x 25 = 300 GB/s per direction.",
        "allreduce_busbw": "sjeaugey, https://github.com/NVIDIA/nccl-tests/issues/149 (8x A100-SXM4-80GB, NVSwitch): "
                           "'The total effective bandwidth should therefore be 240GB/s on A100, but some other "
                           "bottlenecks on the GPUs limits it to ~230GB/s' with an 8G message; "
                           "https://github.com/NVIDIA/nccl-tests/issues/175 measured 232.54 GB/s (8x A100, one "
                           "node, -e 4G). ASSUMPTION: 2 GPUs on NVSwitch see the same per-GPU NVLink bound.",
        "gather_busbw": "ASSUMPTION: the same ~230 GB/s NVLink bound (issue #149). NCCL 2.8's tuning.cc (https://"
                        "github.com/NVIDIA/nccl/blob/01afd20a77b5804e0ecf1042509dd9d20ebf9e93/src/graph/tuning.cc) "
                        "caps every A100 collective: 'if (compCap80) busBw = std::min(busBw, 235.0f)'.",
        "alpha_step_s": f"{NCCL_TUNING}; NVLink.",
        "alpha_base_s": NCCL_TUNING,
    }),
)

H100X8 = System(
    name="8x H100 SXM5 (one HGX/DGX H100 node, NVSwitch)",
    gpu=H100_SXM,
    count=8,
    interconnect="NVLink 4 (18 links per GPU) through NVSwitch, NVLink SHARP (NVLS) all-reduce",
    link_bandwidth=450e9,
    allreduce_busbw=480e9,
    gather_busbw=370e9,
    alpha_step_s=3.4e-6,
    alpha_base_s=8.4e-6,
    sources=MappingProxyType({
        "count": "DGX/HGX H100: 8 H100 SXM5 on one NVSwitch baseboard (nvidia-smi topo: NV18 between every pair, "
                 "https://github.com/NVIDIA/nccl/issues/1264).",
        "link_bandwidth": f"{H100_SHEET}: 'NVLink: 900GB/s' (both directions, 18 links); sjeaugey, "
                          "https://github.com/NVIDIA/nccl-tests/issues/212: '450GB/s is the line rate' per direction.",
        "allreduce_busbw": "sjeaugey (NVIDIA), https://github.com/NVIDIA/nccl-tests/issues/212: 'On 8 GPUs, you should "
                           "reach a peak busBw of ~480GB/s (algbw ~275GB/s)' with NVLink SHARP, on sizes above 256M. "
                           "Check: 8x H200 (same NVLink 4) measured 475 GB/s, -e 4G, NCCL 2.20.3, "
                           "https://github.com/NVIDIA/nccl-tests/issues/272.",
        "gather_busbw": "sjeaugey, nccl-tests issue #212: 'With the protocol overhead (~20%) NCCL can get an effective "
                        "NVLink bandwidth of 370GB/s, which you can observe as BusBw when running non-allreduce "
                        "operations, or when running with NCCL_ALGO=RING'.",
        "alpha_step_s": f"{NCCL_TUNING}; NVLink ring. NVLS all-reduce is modelled by NCCL as one 23 us step.",
        "alpha_base_s": NCCL_TUNING,
    }),
)

NVLINK4_H200 = {
    "link_bandwidth": f"{H200_PAGE}: 'NVIDIA NVLink: 900GB/s' (both directions, 18 links: {MLPERF_H200}); "
                      "sjeaugey, https://github.com/NVIDIA/nccl-tests/issues/212: '450GB/s is the line rate' per "
                      "direction on NVLink 4.",
    "allreduce_busbw": "vitduck, https://github.com/NVIDIA/nccl-tests/issues/272 ('[H200] NCCL's All-reduce "
                       "Performance Exceed 4th Gen NVLINK Spec.'): all_reduce_perf -b 64k -e 4G on 8x 'NVIDIA H200' "
                       "of one node, NCCL 2.20.3: 'peak bandwidth of 475 GB/s' busbw (NVLink SHARP; the H100 "
                       "figure, ~480, is sjeaugey's in nccl-tests issue #212).",
    "gather_busbw": "ASSUMPTION: the H100 node's (same NVLink 4 and NVSwitch): sjeaugey, nccl-tests issue #212: "
                    "'NCCL can get an effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when "
                    "running non-allreduce operations'.",
    "alpha_step_s": f"{NCCL_TUNING}; NVLink ring. NVLS all-reduce is modelled by NCCL as one 23 us step.",
    "alpha_base_s": NCCL_TUNING,
}

H200X8 = System(
    name="8x H200 SXM5 (one HGX H200 node, NVSwitch)",
    gpu=H200_SXM,
    count=8,
    interconnect="NVLink 4 (18 links per GPU) through NVSwitch, NVLink SHARP (NVLS) all-reduce",
    link_bandwidth=450e9,
    allreduce_busbw=475e9,
    gather_busbw=370e9,
    alpha_step_s=3.4e-6,
    alpha_base_s=8.4e-6,
    sources=MappingProxyType({
        "count": f"HGX H200: 8 H200 SXM on one NVSwitch baseboard ({MLPERF_H200}); the 8-GPU node of nccl-tests "
                 "issue #272.",
        **NVLINK4_H200,
    }),
)

H200X1 = System(
    name="1x H200 SXM5 (one GPU of an HGX H200 board)",
    gpu=H200_SXM,
    count=1,
    interconnect="one GPU: no collectives; PCIe Gen5 x16 to the host; NVLink 4 to the board's other GPUs, which "
    "carry the collectives of a run on more of them",
    link_bandwidth=450e9,
    allreduce_busbw=475e9,
    gather_busbw=370e9,
    alpha_step_s=3.4e-6,
    alpha_base_s=8.4e-6,
    sources=MappingProxyType({
        "count": "One GPU, as cloud machines of one H200 give (the SXM part: 700 W, 141 GB; the H200 NVL is a "
                 f"600 W PCIe card with other peaks, not this one). Host link: {H200_PAGE}: 'PCIe Gen5: 128GB/s' "
                 "(both directions; 63 GB/s per direction after encoding, distlab.predict.streams.pcie_GBps(5)). "
                 "On one GPU a step has no collective: its prediction is compute and optimizer only. The NVLink "
                 "figures are the board's, as H200x8's, for a comparison with a run on more of its GPUs.",
        **NVLINK4_H200,
    }),
)

SYSTEMS = {"T4x2": KAGGLE_T4X2, "A100x2": A100X2, "H100x8": H100X8, "H200x8": H200X8, "H200x1": H200X1}

# fmt: on


def evidence(spec: GPU | System, field: str) -> str:
    """How a page labels one input: "assumed" where its source is an ASSUMPTION (a proxy for hardware nobody
    measured, or a figure carried over from another setting), "cited" where a public source states it."""
    return "assumed" if "ASSUMPTION" in spec.sources[field] else "cited"
