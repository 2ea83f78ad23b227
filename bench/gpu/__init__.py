"""GPU validation on one CUDA device: `python -m bench gpu` (`make gpu-check`), the one device script.

Checks, in the order they run (`bench.gpu.runner.STEPS`), each against a peer measured in the same run:

1. `packer` (`packers`): the cupy sign packer, the torch packer on the GPU and the CPU reference give
   identical bytes (±0, ±Inf, NaN and subnormals planted; lengths around byte, chunk and pad boundaries;
   the BERT-Large buffer), and decode alike; pack/unpack GB/s against a device-to-device copy.
2. `allreduce` (`allreduce`): the compressed allreduce with simulated workers on the GPU against the CPU
   reference model at n = 8 and 64, DeepSpeed's exchange and the project's default, with the torch and the
   compiled (Triton) kernels; compute time per worker against one fp32 copy of the buffer.
3. `tests` (`gpu_tests`): `make test-gpu` (`pytest -m gpu`): the packers and compiled kernels on CUDA, the
   whole pipeline on this GPU (tests/gpu/test_pipeline.py: pretrain through the 1-bit compression stage on
   NCCL with the compiled comm kernels, resume, bf16 fine-tune), the NCCL tests (>= 2 GPUs, else skipped
   with the reason); counts, seconds and the pipeline's stage seconds as records.
4. `optim` (`optim_steps`): LAMB's and 1-bit LAMB's steps over BERT-Large's parameters as configured
   (`bench.optim.Contenders`), eager and compiled, against fused AdamW.
5. `throughput` (`throughput`): BERT-Large pretraining forward+backward, bf16, seq 128 (micro-batch 64) and
   512 (16), eager and compiled: samples/s and MFU against NVIDIA's per-GPU figure scaled by peak, each
   compiled step's kernel profile (`results/bench/gpu_kernels.txt`).
6. `arms` (`arms`): the training step's arms of issue #51 (micro-batch, padded vocabulary, CUDA graphs,
   length bins, float8) side by side; `--arms=all` for every arm.

`profile` (`profile`, opt-in: `--steps=...,profile`): one change per arm against the seq-128 step.

FLOPs per sequence (`common.training_flops`): 3 x the forward's matrix products, the encoder on every token,
attention's two T x T products, the MLM head on the masked positions (20 per 128 tokens, 80 per 512,
NVIDIA's max_predictions) and the pooler/NSP head. The same formula gives NVIDIA's MFU.

Records: results/bench/gpu.json (the device's name in every record's `config`), the costliest kernels in
gpu_kernels.txt, logs in gpu_logs/. Exit status 1 when a check fails (different bytes, an allreduce off the
reference, a failed test); performance figures are reported with their targets, not enforced. Without CUDA
it says so and exits 0; `--cpu-smoke` runs every check at toy sizes on the CPU (gpu_smoke.json).

    python -m bench gpu [--steps packer,allreduce,tests,optim,throughput,arms] [--arms default|all|names]
                        [--budget-s 480] [--cpu-smoke]
"""

from __future__ import annotations

from bench.gpu.common import peak_tflops, training_flops
from bench.gpu.packers import packer_lengths
from bench.gpu.runner import main

__all__ = ["main", "packer_lengths", "peak_tflops", "training_flops"]
