"""Benchmarks and profiling tools (CUDA), run from the repository root as modules, e.g.
`python -m benchmarks.bench_kernels` or `torchrun --nproc-per-node 2 -m benchmarks.bench_moe_layer`.
Shared pieces: `rows` (the JSONL result rows) and `common` (the MoE-layer benchmarks' setup and
timing). No benchmark imports another benchmark."""
